"""Image spans in the token sequence (official inference/image_processor.py
`prepare_vl_inputs`). Each `<｜deepseek_image｜>` placeholder becomes
`[START] + ([IMAGE] * llm_w + [NEWLINE]) * llm_h + [END]`; every position of the span keeps the
placeholder's id, and a parallel token type tells them apart. Positions stay ordinary 1-D
positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import numpy as np

# Token types (the reference's values).
TEXT, IMAGE_START, IMAGE, IMAGE_NEWLINE, IMAGE_END = -1, 0, 1, 2, 3


def span_types(llm_h: int, llm_w: int) -> np.ndarray:
    """The token types of one image's span [llm_h * (llm_w + 1) + 2]."""
    row = [IMAGE] * llm_w + [IMAGE_NEWLINE]
    return np.array([IMAGE_START] + row * llm_h + [IMAGE_END], dtype=np.int32)


def placeholder_positions(ids: Sequence[int], image_token_id: int) -> list:
    return [i for i, t in enumerate(ids) if t == image_token_id]


def check_image_count(ids: Sequence[int], image_token_id: int, n_images: int) -> list:
    """The placeholders' positions; ValueError unless there is one image per placeholder."""
    where = placeholder_positions(ids, image_token_id)
    if len(where) != n_images:
        raise ValueError(f"the prompt has {len(where)} image placeholder(s) (token "
                         f"{image_token_id}, <｜deepseek_image｜>) but {n_images} image(s) were "
                         "given: pass one image per placeholder, in order")
    return where


def expand_spans(ids: Sequence[int], image_token_id: int, grids: list) -> tuple:
    """Expand each placeholder of `ids` (one per grid, in order) into its span.

    Returns:
        (ids list, token types int32 [S], span starts list), S = the expanded length.
    """
    where = check_image_count(ids, image_token_id, len(grids))
    out_ids, types, starts, previous = [], [], [], 0
    for position, grid in zip(where, grids):
        out_ids += list(ids[previous:position])
        types.append(np.full(position - previous, TEXT, np.int32))
        span = span_types(grid.llm_h, grid.llm_w)
        starts.append(len(out_ids))
        out_ids += [image_token_id] * len(span)
        types.append(span)
        previous = position + 1
    out_ids += list(ids[previous:])
    types.append(np.full(len(ids) - previous, TEXT, np.int32))
    return out_ids, np.concatenate(types), starts


@dataclass
class ImageInputs:
    """The image spans of one forward call (batch 1): the token type of every position of the
    call, and the aligner rows of its IMAGE positions in order ([rows, hidden] bf16). With
    `has_delimiter_rows` the rows are every span position's, the learned delimiters included
    (what another rank's tower made: `mlx_v41.distributed.prompt`), and merge needs no tower."""

    token_types: np.ndarray
    rows: mx.array
    has_delimiter_rows: bool = False

    @property
    def has_spans(self) -> bool:
        return bool(np.any(self.token_types >= 0))

    @property
    def n_image_rows(self) -> int:
        """How many rows the call takes (one per IMAGE position, or per span position)."""
        return int(np.count_nonzero(self._takes_row(self.token_types)))

    def _takes_row(self, types: np.ndarray) -> np.ndarray:
        return types >= 0 if self.has_delimiter_rows else types == IMAGE

    def chunk(self, begin: int, end: int) -> "ImageInputs":
        """The inputs of positions [begin, end) of the call."""
        first = int(np.count_nonzero(self._takes_row(self.token_types[:begin])))
        types = self.token_types[begin:end]
        rows = self.rows[first:first + int(np.count_nonzero(self._takes_row(types)))]
        return ImageInputs(types, rows, self.has_delimiter_rows)

    def mask(self) -> mx.array:
        """[1, S] bool: positions inside an image span (delimiters included)."""
        return mx.array(self.token_types >= 0)[None]

    def merge(self, x: mx.array, delimiters: dict) -> mx.array:
        """Token embeddings x [1, S, D] with the span rows overwritten: IMAGE rows by the
        aligner rows, the others by the learned vectors (`delimiters`: type -> [D]; unused
        with `has_delimiter_rows`)."""
        takes_row = self._takes_row(self.token_types)
        if self.rows.shape[0]:
            slot = np.maximum(np.cumsum(takes_row) - 1, 0)
            gathered = self.rows.astype(x.dtype)[mx.array(slot)][None]
            x = mx.where(mx.array(takes_row)[None, :, None], gathered, x)
        if self.has_delimiter_rows:
            return x
        types = mx.array(self.token_types)[None, :, None]
        for kind, vector in delimiters.items():
            x = mx.where(types == kind, vector.astype(x.dtype), x)
        return x
