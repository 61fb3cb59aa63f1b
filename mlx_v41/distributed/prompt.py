"""An image prompt across ranks: rank 0 alone holds the vision tower and reads the images, so it
prepares the prompt (expands each placeholder into its span) and the other ranks receive the
expanded ids by `all_sum`. A pipeline's later ranks get the image mask with the rows; under
tensor parallel every rank also gets the token types and, per forward, rank 0's span rows."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from ..model.vision.prompt import ImagePrompt, delimiters, prepare_prompt
from ..model.vision.spans import TEXT, ImageInputs, span_types
from .lines import share_line

FAILED = -1  # the id count rank 0 shares when it could not prepare the prompt


def prepare_shared_prompt(model, ids: Sequence[int], images: Optional[Sequence], group
                          ) -> ImagePrompt:
    """`prepare_prompt` across the ranks of `group` (a `RankGroup`): rank 0's expanded ids on
    every rank (the images on rank 0 only): `all_sum`s of the id and image counts, then of the
    int32 ids (under tensor parallel the ids and the token types); with images, their records as
    one JSON line. ValueError on every rank when rank 0 failed."""
    link = group.link
    prompt = error = None
    if link.rank == 0:
        try:
            prompt = prepare_prompt(model, ids, images)
        except (ValueError, OSError) as e:
            error = e
    head = [0, 0]  # rank 0's (id count, image count)
    if link.rank == 0:
        head = [FAILED, 0] if error is not None else [len(prompt.ids), len(prompt.starts)]
    total, spans = link.all_sum(mx.array(head, mx.int32), "sharing the prompt").tolist()
    if total == FAILED:
        message = share_line(link, str(error).splitlines()[0] if error is not None else None)
        if error is not None:
            raise error
        raise ValueError(f"rank 0 could not prepare the prompt: {message}")
    records = _share_records(link, prompt) if spans else []
    if group.is_pipeline:  # the mask travels with the rows
        shared = _share_ints(link, prompt.ids if prompt else None, total)
        return prompt if link.rank == 0 else \
            SharedImagePrompt(shared, np.full(total, TEXT, np.int32), rank0_records=records)
    mine = None if prompt is None else list(prompt.ids) + prompt.token_types.tolist()
    shared = _share_ints(link, mine, 2 * total)
    if link.rank == 0:
        return leading_prompt(group, prompt)
    return SharedImagePrompt(shared[:total], np.array(shared[total:], np.int32), link=link,
                             rank0_records=records)


def leading_prompt(group, prompt: ImagePrompt) -> ImagePrompt:
    """Rank 0's `prompt` as the ranks of `group` run it: under tensor parallel its `inputs`
    shares the span rows; under a pipeline as it is."""
    if group.is_pipeline:
        return prompt
    return SharedImagePrompt(prompt.ids, prompt.token_types, prompt.images, prompt.starts,
                             group.link)


def span_grids(prompt: ImagePrompt) -> list:
    """[start, llm_h, llm_w] of each image span: what another rank needs to rebuild the token
    types (`followed_prompt`)."""
    return [[start, image.grid.llm_h, image.grid.llm_w]
            for start, image in zip(prompt.starts, prompt.images)]


def followed_prompt(group, ids: list, grids: list, records: Optional[list] = None
                    ) -> ImagePrompt:
    """Rank 0's prompt on another rank of `group`, from its expanded ids, `span_grids` and
    `records()` (what its caches are keyed and named by): under a pipeline all text (the mask
    comes with the rows); under tensor parallel with the token types, and `inputs` takes rank
    0's span rows."""
    types = np.full(len(ids), TEXT, np.int32)
    if group.is_pipeline:
        return SharedImagePrompt(list(ids), types, rank0_records=records)
    for start, llm_h, llm_w in grids:
        span = span_types(llm_h, llm_w)
        types[start:start + len(span)] = span
    return SharedImagePrompt(list(ids), types, link=group.link, rank0_records=records)


def _share_records(link, prompt: Optional[ImagePrompt]) -> list:
    """Rank 0's span records (start, length, pixels' sha256: what a prompt cache compares) on
    every rank, as one JSON line."""
    return json.loads(share_line(link, json.dumps(prompt.records()) if prompt else None))


def _share_ints(link, values: Optional[list], count: int) -> list:
    """Rank 0's `count` int32 `values` on every rank (the others pass None)."""
    mine = mx.array(np.array(values, np.int32)) if link.rank == 0 else \
        mx.zeros((count,), mx.int32)
    return np.array(link.all_sum(mine, "sharing the prompt")).tolist()


@dataclass
class SharedImagePrompt(ImagePrompt):
    """An `ImagePrompt` prepared by rank 0 of a group. On the other ranks `images` is empty and
    `records()` are rank 0's. Under tensor parallel (`link` given) every rank calls `inputs`
    together: rank 0 runs the tower, and the rows of the call's span positions (IMAGE rows and
    delimiters, [n, hidden] bf16) reach every rank by one `all_sum` (the others add zeros)."""

    link: object = None
    rank0_records: Optional[list] = None

    def records(self) -> list:
        return super().records() if self.rank0_records is None else self.rank0_records

    def inputs(self, model, begin: int = 0) -> Optional[ImageInputs]:
        types = self.token_types[begin:]
        if self.link is None or not np.any(types >= 0):
            return super().inputs(model, begin)
        mine = mx.zeros((int(np.count_nonzero(types >= 0)), model.cfg.hidden_size),
                        mx.bfloat16)
        failure = None
        if self.link.rank == 0:
            try:  # the tower runs here: its errors surface before the others wait for rows
                mine = span_rows(super().inputs(model, begin), model)
                mx.eval(mine)
            except Exception as e:  # every rank fails this call alike (one int32 first)
                failure = e
        failed = self.link.all_sum(mx.array([int(failure is not None)], mx.int32),
                                   "sharing whether the image rows were made").item()
        if failure is not None:
            raise failure
        if failed:
            raise ValueError(f"rank 0 could not compute the image rows (its error is on rank "
                             f"0); rank {self.link.rank} stops this call too")
        rows = self.link.all_sum(mine, "sharing the image rows")
        return ImageInputs(types, rows, has_delimiter_rows=True)


def span_rows(images: ImageInputs, model) -> mx.array:
    """The embedding rows `images` puts at its span positions, in order [n, hidden] bf16."""
    types = images.token_types
    merged = images.merge(mx.zeros((1, len(types), model.cfg.hidden_size), mx.bfloat16),
                          delimiters(model))
    return merged[0][mx.array(np.flatnonzero(types >= 0))]
