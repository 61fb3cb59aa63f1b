"""A prompt with images: its expanded token ids and types, the prepared images, and the
tower's rows for the positions a forward still has to run. The tower runs only for images
whose spans reach past the reused prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from .preprocess import PreparedImage, prepare_image
from .spans import IMAGE, IMAGE_END, IMAGE_NEWLINE, IMAGE_START, ImageInputs, expand_spans

VISION_MISSING = ("the model has no vision tower (a checkpoint without vision.* tensors, or "
                  "loaded with vision=False)")


def has_vision(model) -> bool:
    return "vision" in model


def image_rows(model, image: PreparedImage) -> mx.array:
    """The ViT and aligner over one image -> its IMAGE rows [llm_h * llm_w, hidden] bf16."""
    if not has_vision(model):
        raise ValueError(f"an image was given but {VISION_MISSING}")
    grid = image.grid
    features = model.vision(image.patches, grid.vit_h, grid.vit_w)
    rows = model.aligner(features, grid.vit_h, grid.vit_w)
    mx.eval(rows)  # one image's tower graph at a time
    return rows


def delimiters(model) -> dict:
    """token type -> the learned vector of that span position."""
    return {IMAGE_START: model.image_start, IMAGE_NEWLINE: model.image_newline,
            IMAGE_END: model.image_end}


@dataclass
class ImagePrompt:
    """Token ids with each image placeholder expanded into its span.

    ids: the expanded ids; token_types: int32 [len(ids)] (-1 text); images and starts: each
    image and the index of its span's first position in `ids`.
    """

    ids: list
    token_types: np.ndarray
    images: list = field(default_factory=list)
    starts: list = field(default_factory=list)

    def records(self) -> list:
        """What each span's positions came from: start, length and the pixels' sha256 (what a
        prompt cache keeps so a reused prefix is never paired with another image)."""
        return [{"start": s, "length": image.grid.span_tokens, "sha256": image.sha256}
                for s, image in zip(self.starts, self.images)]

    def inputs(self, model, begin: int = 0) -> Optional[ImageInputs]:
        """`ImageInputs` for positions [begin, len(ids)), or None when no span reaches them;
        the tower runs only for those images."""
        types = self.token_types[begin:]
        if not np.any(types >= 0):
            return None
        rows = []
        for start, image in zip(self.starts, self.images):
            if start + image.grid.span_tokens <= begin:
                continue
            image_rows_before = _image_positions(self.token_types[start:max(begin, start)])
            rows.append(image_rows(model, image)[image_rows_before:])
        hidden = model.cfg.hidden_size
        merged = mx.concatenate(rows) if rows else mx.zeros((0, hidden), mx.bfloat16)
        return ImageInputs(types, merged)


def _image_positions(types: np.ndarray) -> int:
    return int(np.count_nonzero(types == IMAGE))


def prepare_prompt(model, ids: Sequence[int], images: Optional[Sequence] = None) -> ImagePrompt:
    """Expand the image placeholders of `ids` (one per image, in order) into spans.

    `images` are anything `preprocess.load_image` reads (paths, bytes, data URIs, URLs, PIL
    images, chat image blocks). ValueError when their count differs from the placeholders'
    or when images are given to a model without the tower.
    """
    images = list(images or [])
    if images and not has_vision(model):
        raise ValueError(f"{len(images)} image(s) given but {VISION_MISSING}")
    prepared = [prepare_image(source, model.args.vision_config) for source in images]
    expanded, types, starts = expand_spans(list(ids), model.args.image_token_id,
                                           [p.grid for p in prepared])
    return ImagePrompt(expanded, types, prepared, starts)
