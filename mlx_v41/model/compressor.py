"""Compressor of a kv-source layer: one RoPE-free latent per completed group of `ratio` tokens
(official inference/model.py L429–485). Ratio 2 pools each channel with an fp32 softmax gate
over the group's two tokens; the first token of an open group waits in the cache until the group
completes.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..cache.layer import CompressedKV
from ..cache.stacked import row_shape, share, stacked as stacked_rows
from .stacked import split_rows, stack, take_rows
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

    def stacked(self, x: mx.array, stores: list, starts: tuple) -> list:
        """`__call__` of G sequences at once, x [G, S, D] (row g at position starts[g] of
        stores[g]): the projections over all rows, the input rings in one update, and the
        groups pooled together for the sequences with as long an open group (same shapes)
        -> [(members, latents [M, groups, d] bf16, first group index of each member)]."""
        if self.ratio == 1:
            return [(list(range(len(stores))), self.kv_norm(self.kv_proj(x)), list(starts))]
        k, s = self.kv_proj(x), self.gate_proj(x)
        _remember_stacked(stores, k, s, starts)
        phases: dict = {}
        for g, store in enumerate(stores):
            phases.setdefault(0 if store.pending is None else store.pending[0].shape[1],
                              []).append(g)
        return [self._pool_phase(members, take_rows(k, members), take_rows(s, members), stores,
                                 starts)
                for members in phases.values()]

    def _pool_phase(self, members: list, k: mx.array, s: mx.array, stores: list,
                    starts: tuple) -> tuple:
        """The groups of `members` (each with an open group of the same length)."""
        if stores[members[0]].pending is not None:
            k = mx.concatenate([stack([stores[g].pending[0] for g in members]), k], axis=1)
            s = mx.concatenate([stack([stores[g].pending[1] for g in members]), s], axis=1)
        groups = k.shape[1] // self.ratio
        tail = k.shape[1] - groups * self.ratio
        opened = zip(split_rows(k[:, -tail:]), split_rows(s[:, -tail:])) if tail \
            else [None] * len(members)
        for g, pending in zip(members, opened):
            stores[g].pending = pending
        batch, _, dim = k.shape
        k = k[:, :groups * self.ratio].reshape(batch, groups, self.ratio, dim)
        s = s[:, :groups * self.ratio].reshape(batch, groups, self.ratio, dim)
        latents = mx.sum(mx.softmax(s, axis=2) * k, axis=2)
        firsts = [starts[g] // self.ratio for g in members]
        return members, self.kv_norm(latents.astype(mx.bfloat16)), firsts


def _remember_stacked(stores: list, k: mx.array, s: mx.array, starts: tuple) -> None:
    """`remember_inputs` of every store: one update of the stacked rings where all hold a
    ring of the same shape with room for the rows, else one by one."""
    batch, length = k.shape[:2]
    history = stores[0].history
    shapes = {(store.history, row_shape(store, "inputs")) for store in stores}
    if not history or length > history or len(shapes) > 1 or (history, None) in shapes:
        for g, store in enumerate(stores):
            store.remember_inputs(k[g:g + 1], s[g:g + 1], starts[g])
        return
    slots = (mx.array(starts)[:, None] + mx.arange(length)) % history
    rows = mx.put_along_axis(stacked_rows(stores, "inputs"), slots.reshape(batch, length, 1, 1),
                             mx.stack([k, s], axis=2), axis=1)
    share(stores, "inputs", rows)  # the next step finds them stacked
