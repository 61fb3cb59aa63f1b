"""Engram: hashed n-gram memory added into all residual copies before its layers (spec
engram.md §5). Table rows stay FP8 with one E8M0 scale per 32 values and are dequantised only
for the rows a token looks up; a gate per copy decides how much of the shared value to add.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .layers import QuantLinear
from .quant import e4m3_to_float, e8m0_to_float

GATE_FLOOR = 1e-6  # clamp on |dot| before the signed square root


class EngramTable(nn.Module):
    """FP8 E4M3 rows `[rows, head_dim]` with E8M0 scales `[rows, head_dim / 32]`."""

    def __init__(self, rows: int, head_dim: int):
        super().__init__()
        self.weight = mx.zeros((rows, head_dim), dtype=mx.uint8)
        self.scales = mx.zeros((rows, head_dim // 32), dtype=mx.uint8)

    def __call__(self, ids: mx.array) -> mx.array:
        """ids [...] -> dequantised rows [..., head_dim] bf16."""
        values = e4m3_to_float(self.weight[ids])
        scales = e8m0_to_float(self.scales[ids])
        values = values.reshape(*values.shape[:-1], scales.shape[-1], -1) * scales[..., None]
        return values.reshape(*ids.shape, -1).astype(mx.bfloat16)


class Engram(nn.Module):
    def __init__(self, hidden: int, hc_mult: int, rows: int, n_columns: int, head_dim: int,
                 eps: float):
        super().__init__()
        self.embed = EngramTable(rows, head_dim)
        self.kv_proj = QuantLinear(n_columns * head_dim, hidden * (hc_mult + 1))
        self.q_weight = mx.zeros((hc_mult, hidden), dtype=mx.bfloat16)
        self.k_weight = mx.zeros((hc_mult, hidden), dtype=mx.bfloat16)
        self.hc_mult, self.hidden, self.eps = hc_mult, hidden, eps

    def __call__(self, streams: mx.array, row_ids: mx.array) -> mx.array:
        """streams [B, S, n, D] bf16, row_ids [B, S, columns] -> updated streams."""
        batch, length, n, dim = streams.shape
        memory = self.embed(row_ids).reshape(batch, length, -1)
        kv = self.kv_proj(memory).astype(mx.float32)
        key = kv[..., :n * dim].reshape(batch, length, n, dim)
        value = kv[..., n * dim:]
        weight = self.q_weight.astype(mx.float32) * self.k_weight.astype(mx.float32)
        h = streams.astype(mx.float32)
        rho = mx.rsqrt(mx.mean(h * h, axis=-1) + self.eps) * \
            mx.rsqrt(mx.mean(key * key, axis=-1) + self.eps)
        dot = mx.sum(h * weight * key, axis=-1) * rho / (dim ** 0.5)
        negative = (dot.view(mx.uint32) >> 31) == 1       # copysign keeps the sign of -0.0
        root = mx.sqrt(mx.maximum(mx.abs(dot), GATE_FLOOR))
        gate = mx.sigmoid(mx.where(negative, -root, root))
        return (h + gate[..., None] * value[:, :, None, :]).astype(streams.dtype)
