"""Compressor of a kv-source layer: one RoPE-free latent per completed group of `ratio` tokens
(official inference/model.py L429–485). Ratio 2 pools each channel with an fp32 softmax gate
over the group's two tokens; the first token of an open group waits in the cache until the group
completes.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..cache.layer import CompressedKV
from .layers import Linear, RMSNorm


class Compressor(nn.Module):
    def __init__(self, hidden: int, head_dim: int, ratio: int, eps: float):
        super().__init__()
        self.ratio = ratio
        self.kv_proj = Linear(hidden, head_dim, fp32=ratio > 1)
        if ratio > 1:
            self.gate_proj = Linear(hidden, head_dim, fp32=True)
        self.kv_norm = RMSNorm(head_dim, eps)

    def __call__(self, x: mx.array, store: CompressedKV, offset: int):
        """x [B, S, D] at positions offset.. -> (latents [B, G, d] bf16, first group index)."""
        if self.ratio == 1:
            return self.kv_norm(self.kv_proj(x)), offset
        k, s = self.kv_proj(x), self.gate_proj(x)
        store.remember_inputs(k, s, offset)
        if store.pending is not None:
            k = mx.concatenate([store.pending[0], k], axis=1)
            s = mx.concatenate([store.pending[1], s], axis=1)
        first_group = offset // self.ratio
        groups = k.shape[1] // self.ratio
        tail = k.shape[1] - groups * self.ratio
        store.pending = (k[:, -tail:], s[:, -tail:]) if tail else None
        batch, _, dim = k.shape
        k = k[:, :groups * self.ratio].reshape(batch, groups, self.ratio, dim)
        s = s[:, :groups * self.ratio].reshape(batch, groups, self.ratio, dim)
        latents = mx.sum(mx.softmax(s, axis=2) * k, axis=2)
        return self.kv_norm(latents.astype(mx.bfloat16)), first_group
