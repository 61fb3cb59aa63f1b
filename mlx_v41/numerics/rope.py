"""Rotary position embedding on the trailing `qk_rope_head_dim` channels, with YaRN.

Interleaved pairs (GPT-J style, MLX `traditional=True`) rotated in fp32
(official inference/model.py L368–406, L680–698).
Angles are computed from the positions of each call, so no table grows with the context length.
A batch of sequences at their own positions gives each row of axis 0 its first position.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Optional

import mlx.core as mx
import numpy as np


def rope_frequencies(rope_dim: int, base: float, scaling: Optional[dict]) -> np.ndarray:
    """Per-pair inverse frequencies (fp32), YaRN-blended when `scaling` is given."""
    exponents = np.arange(0, rope_dim, 2, dtype=np.float32) / np.float32(rope_dim)
    freqs = (np.float32(1.0) / (np.float32(base) ** exponents)).astype(np.float32)
    if not scaling:
        return freqs
    orig = scaling["original_max_position_embeddings"]
    factor = scaling["factor"]

    def correction_dim(rotations):
        return rope_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(scaling["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(scaling["beta_slow"])), rope_dim - 1)
    if low == high:
        high += 0.001  # the reference's guard against a zero-width ramp
    ramp = np.clip((np.arange(rope_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    ramp = ramp.astype(np.float32)
    return (freqs / np.float32(factor) * ramp + freqs * (1 - ramp)).astype(np.float32)


TABLES_KEPT = 16  # rotation tables kept per RoPE: the layers of one call share them
ROW_TABLES_KEPT = 4  # per-row tables kept per RoPE (a batch's forward and inverse, kept apart
# so that the per-sequence tables of the same call do not push them out)


@functools.lru_cache(maxsize=None)
def shared_rope(rope_dim: int, base: float, scaling: Optional[tuple] = None) -> "RoPE":
    """One RoPE per distinct configuration, so all layers of a call reuse its angle tables."""
    return RoPE(rope_dim, base, dict(scaling) if scaling else None)


class RoPE:
    """Rotates the last `rope_dim` channels of `[B, S, ..., D]` by the angle `position * freq`.

    Pair (re, im) becomes (re cos + im (-sin), im cos + re sin): the bits of
    (re cos - im sin, re sin + im cos), written as x * C + swap(x) * S' over the whole row
    (C = cos, S' = (-sin, sin) per pair; channels before the rotated tail pass through a
    select), so that the rotation is one fused kernel.
    """

    def __init__(self, rope_dim: int, base: float, scaling: Optional[dict] = None):
        self.rope_dim = rope_dim
        self.freqs = mx.array(rope_frequencies(rope_dim, base, scaling))
        self._kept = threading.local()

    @property
    def _tables(self) -> dict:
        """This thread's kept tables: a table is made lazily on the thread's MLX stream, and
        another thread (the prompt thread beside the decode steps) must not read it before
        that stream has computed it."""
        return self._kept.__dict__.setdefault("tables", {})

    @property
    def _row_tables(self) -> dict:
        return self._kept.__dict__.setdefault("rows", {})

    def angles(self, positions):
        """(cos, sin) [S, rope_dim / 2] of an array of positions."""
        theta = positions.astype(mx.float32)[:, None] * self.freqs[None, :]
        return mx.cos(theta), mx.sin(theta)

    def cos_sin(self, positions):
        """(cos, sin) [S, rope_dim / 2] fp32 for fused kernels that rotate in place of
        `__call__`: `positions` an array, or (start, S) for contiguous rows (kept, like
        `tables`, so every layer of a call shares them)."""
        if isinstance(positions, mx.array):
            return self.angles(positions)
        key = (*positions, "angles")
        if key not in self._tables:
            if len(self._tables) >= TABLES_KEPT:
                self._tables.pop(next(iter(self._tables)))
            start, length = positions
            self._tables[key] = self.angles(mx.arange(start, start + length))
        return self._tables[key]

    def tables(self, positions, width: int, inverse: bool):
        """(C, S') [S, width / 2, 2] for rows of `width` channels; `positions` an array, or
        (start, S) for the contiguous rows start .. start + S - 1 (kept, as every layer of a
        call asks again)."""
        if isinstance(positions, mx.array):
            return self._tables_of(positions, width, inverse)
        key = (*positions, width, inverse)
        if key not in self._tables:
            if len(self._tables) >= TABLES_KEPT:
                self._tables.pop(next(iter(self._tables)))
            start, length = positions
            self._tables[key] = self._tables_of(mx.arange(start, start + length), width,
                                                inverse)
        return self._tables[key]

    def row_tables(self, starts: tuple, length: int, width: int, inverse: bool):
        """(C, S') [B, length, width / 2, 2] for B rows of contiguous positions, row b from
        starts[b] on: the rows of `tables` of each start, as one table (kept, as every layer
        of a call asks again). An angle's bits do not depend on its neighbours, so row b
        equals `tables((starts[b], length), ...)`."""
        key = (starts, length, width, inverse)
        if key not in self._row_tables:
            if len(self._row_tables) >= ROW_TABLES_KEPT:
                self._row_tables.pop(next(iter(self._row_tables)))
            positions = np.asarray(starts, np.int64)[:, None] + np.arange(length)
            cos2, sin2 = self._tables_of(mx.array(positions.reshape(-1).astype(np.int32)),
                                         width, inverse)
            shape = (len(starts), length, width // 2, 2)
            self._row_tables[key] = cos2.reshape(shape), sin2.reshape(shape)
        return self._row_tables[key]

    def _tables_of(self, positions: mx.array, width: int, inverse: bool):
        cos, sin = self.angles(positions)
        if inverse:
            sin = -sin
        keep = (width - self.rope_dim) // 2  # pairs before the rotated tail
        ones, zeros = mx.ones((cos.shape[0], keep)), mx.zeros((cos.shape[0], keep))
        c = mx.concatenate([ones, cos], axis=-1)
        cos2 = mx.stack([c, c], axis=-1)
        sin2 = mx.stack([mx.concatenate([zeros, -sin], axis=-1),
                         mx.concatenate([zeros, sin], axis=-1)], axis=-1)
        return cos2, sin2

    def __call__(self, x: mx.array, positions, inverse: bool = False, dtype=None) -> mx.array:
        """`positions`: [S] absolute positions of axis 1 of `x`, or the int position of its
        first row (contiguous rows; their tables are shared by every layer), or a tuple of B
        ints: the first position of each row of axis 0 (sequences of a batch, each at its own
        position). Output in x's dtype; `dtype` casts it inside the rotation's fused kernel
        (fp32 for an fp32 reader)."""
        width = x.shape[-1]
        extra = x.ndim - 3  # head axes between the sequence and feature axes
        if isinstance(positions, tuple):
            if len(positions) != x.shape[0]:
                raise ValueError(f"RoPE: {len(positions)} row positions for {x.shape[0]} rows")
            cos2, sin2 = self.row_tables(positions, x.shape[1], width, inverse)
            shape = cos2.shape[:2] + (1,) * extra + (width // 2, 2)
        else:
            if not isinstance(positions, mx.array):
                positions = (int(positions), x.shape[1])
            cos2, sin2 = self.tables(positions, width, inverse)
            shape = (1, cos2.shape[0]) + (1,) * extra + (width // 2, 2)
        return _compiled_rotate(dtype or x.dtype)(x, cos2.reshape(shape), sin2.reshape(shape),
                                                  _rotated_pairs(width, self.rope_dim))


@functools.cache
def _rotated_pairs(width: int, rope_dim: int) -> mx.array:
    """[width / 2, 2] bool: True on the rotated tail's channels."""
    mask = mx.arange(width // 2)[:, None] >= (width - rope_dim) // 2
    mask = mx.broadcast_to(mask, (width // 2, 2))
    mx.eval(mask)
    return mask


def _rotate(x: mx.array, cos2: mx.array, sin2: mx.array, rotated: mx.array, dtype) -> mx.array:
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    turned = pairs.astype(mx.float32) * cos2 + pairs[..., ::-1].astype(mx.float32) * sin2
    out = mx.where(rotated, turned.astype(x.dtype), pairs).astype(dtype)  # before the view
    return out.reshape(x.shape)


@functools.cache
def _compiled_rotate(dtype):
    return mx.compile(functools.partial(_rotate, dtype=dtype))
