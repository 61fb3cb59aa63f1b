"""Rotary position embedding on the trailing `qk_rope_head_dim` channels, with YaRN.

Interleaved pairs (GPT-J style, MLX `traditional=True`) rotated in fp32
(official inference/model.py L368–406, L680–698).
Angles are computed from the positions of each call, so no table grows with the context length.
"""

from __future__ import annotations

import functools
import math
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


TABLES_KEPT = 8  # (start, length) angle tables kept per RoPE: the layers of one call share them


@functools.lru_cache(maxsize=None)
def shared_rope(rope_dim: int, base: float, scaling: Optional[tuple] = None) -> "RoPE":
    """One RoPE per distinct configuration, so all layers of a call reuse its angle tables."""
    return RoPE(rope_dim, base, dict(scaling) if scaling else None)


class RoPE:
    """Rotates the last `rope_dim` channels of `[B, S, ..., D]` by the angle `position * freq`."""

    def __init__(self, rope_dim: int, base: float, scaling: Optional[dict] = None):
        self.rope_dim = rope_dim
        self.freqs = mx.array(rope_frequencies(rope_dim, base, scaling))
        self._tables: dict = {}

    def angles(self, positions):
        """(cos, sin) [S, rope_dim / 2]; `positions` an array, or (start, S) for the
        contiguous rows start .. start + S - 1 (kept, as every layer of a call asks again)."""
        if isinstance(positions, mx.array):
            return self._angles(positions)
        start, length = positions
        key = (start, length)
        if key not in self._tables:
            if len(self._tables) >= TABLES_KEPT:
                self._tables.pop(next(iter(self._tables)))
            self._tables[key] = self._angles(mx.arange(start, start + length))
        return self._tables[key]

    def _angles(self, positions: mx.array):
        theta = positions.astype(mx.float32)[:, None] * self.freqs[None, :]
        return mx.cos(theta), mx.sin(theta)

    def __call__(self, x: mx.array, positions, inverse: bool = False) -> mx.array:
        """`positions`: [S] absolute positions of axis 1 of `x`, or the int position of its
        first row (contiguous rows; their angle table is shared by every layer)."""
        r = self.rope_dim
        if not isinstance(positions, mx.array):
            positions = (int(positions), x.shape[1])
        cos, sin = self.angles(positions)
        if inverse:
            sin = -sin
        extra = x.ndim - 3  # head axes between the sequence and feature axes
        shape = (1, cos.shape[0]) + (1,) * extra + (r // 2,)
        cos, sin = cos.reshape(shape), sin.reshape(shape)
        tail = x[..., -r:].astype(mx.float32).reshape(*x.shape[:-1], r // 2, 2)
        re, im = tail[..., 0], tail[..., 1]
        rotated = mx.stack([re * cos - im * sin, re * sin + im * cos], axis=-1)
        rotated = rotated.reshape(*x.shape[:-1], r).astype(x.dtype)
        return mx.concatenate([x[..., :-r], rotated], axis=-1)
