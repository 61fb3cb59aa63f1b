"""An image prompt under `--pipeline`: rank 0 alone holds the vision tower, so it prepares the
prompt (loads the images, expands each placeholder into its span) and every rank receives the
expanded token ids (two `all_sum`s: their count, then the int32 ids). The later ranks' prompt
has no images: they are called without them, and the image mask of each call reaches them with
the rows (`pipeline.Stage`). A prompt rank 0 cannot prepare ends every rank with its line."""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from ..model.vision.prompt import ImagePrompt, prepare_prompt
from ..model.vision.spans import TEXT
from .lines import share_line

FAILED = -1  # the id count rank 0 shares when it could not prepare the prompt


def prepare_shared_prompt(model, ids: Sequence[int], images: Optional[Sequence] = None
                          ) -> ImagePrompt:
    """`prepare_prompt` for any model; for a pipeline (`model.stage`), rank 0's expanded ids on
    every rank (with the images on rank 0 only). ValueError on every rank when rank 0 failed."""
    stage = getattr(model, "stage", None)
    if stage is None:
        return prepare_prompt(model, ids, images)
    link = stage.link
    prompt = error = None
    if stage.first:
        try:
            prompt = prepare_prompt(model, ids, images)
        except (ValueError, OSError) as e:
            error = e
    count = (FAILED if error is not None else len(prompt.ids)) if stage.first else 0
    total = int(link.all_sum(mx.array([count], mx.int32), "sharing the prompt").item())
    if total == FAILED:
        message = share_line(link, str(error).splitlines()[0] if error is not None else None)
        if error is not None:
            raise error
        raise ValueError(f"rank 0 could not prepare the prompt: {message}")
    mine = mx.array(np.array(prompt.ids, np.int32)) if stage.first else \
        mx.zeros((total,), mx.int32)
    shared = np.array(link.all_sum(mine, "sharing the prompt")).tolist()
    if stage.first:
        return prompt
    return ImagePrompt(shared, np.full(total, TEXT, np.int32))
