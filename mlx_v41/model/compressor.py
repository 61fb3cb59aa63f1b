"""Compressor of a kv-source layer: one RoPE-free latent per completed group of `ratio` tokens
(official inference/model.py L429–485). Ratio 2 pools each channel with an fp32 softmax gate
over the group's two tokens; the first token of an open group waits in the cache until the group
completes.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

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
        pending = store.pending  # before the ring moves on (it may be a slot of the ring)
        store.remember_inputs(k, s, offset)
        if pending is not None:
            k = mx.concatenate([pending[0], k], axis=1)
            s = mx.concatenate([pending[1], s], axis=1)
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
        groups pooled together for the sequences that complete as many groups
        -> [(members, latents [M, groups, d] bf16, first group index of each member)]."""
        if self.ratio == 1:
            return [(list(range(len(stores))), self.kv_norm(self.kv_proj(x)), list(starts))]
        k, s = self.kv_proj(x), self.gate_proj(x)
        length = k.shape[1]
        stacks = _rings_stack(stores, length)
        if stacks and self.ratio == 2 and length < stores[0].history:  # + the open group
            _put_stacked(stores, k, s, starts)
            return self._pool_ring(stores, starts, length)
        opened = [store.pending for store in stores]  # before the rings move on
        if stacks:
            _put_stacked(stores, k, s, starts)
        else:
            for g, store in enumerate(stores):
                store.remember_inputs(k[g:g + 1], s[g:g + 1], starts[g])
        phases: dict = {}
        for g, pending in enumerate(opened):
            phases.setdefault(0 if pending is None else pending[0].shape[1], []).append(g)
        return [self._pool_phase(members, take_rows(k, members), take_rows(s, members),
                                 [opened[g] for g in members], stores, starts)
                for members in phases.values()]

    def _pool_ring(self, stores: list, starts: tuple, length: int) -> list:
        """`stacked`'s pooling where the stores share one input ring that holds every token
        of the groups the step completes, the open ones included (ratio 2, fewer new rows than
        the ring): one gather of each sequence's groups from the ring and one pooling for
        all, where the open groups would be stacked and split again every step. The open
        group a step leaves stays in the ring (`open_at`)."""
        history, batch = stores[0].history, len(stores)
        start = np.asarray(starts)
        first = start - start % 2  # each sequence's first position of a group it completes
        counts = (start % 2 + length) // 2  # the groups each completes
        for store, end in zip(stores, start + length):
            store.pending = None
            if end % 2:
                store.open_at(int(end - 1) % history)
        most = int(counts.max())
        if most == 0:
            return []
        slots = (first[:, None] + np.arange(2 * most)) % history  # past a short one's end:
        rows = mx.take_along_axis(  # rows it leaves out below
            stacked_rows(stores, "inputs"),
            mx.array(slots.astype(np.int32)).reshape(batch, 2 * most, 1, 1), axis=1)
        rows = rows.reshape(batch, most, 2, 2, rows.shape[-1])  # [G, groups, token, (k, s), d]
        latents = mx.sum(mx.softmax(rows[..., 1, :], axis=2) * rows[..., 0, :], axis=2)
        latents = self.kv_norm(latents.astype(mx.bfloat16))
        made = []
        for n in sorted(set(counts.tolist()) - {0}, reverse=True):
            members = [g for g in range(batch) if counts[g] == n]
            made.append((members, take_rows(latents, members)[:, :n],
                         [int(first[g]) // 2 for g in members]))
        return made

    def _pool_phase(self, members: list, k: mx.array, s: mx.array, opened: list,
                    stores: list, starts: tuple) -> tuple:
        """The groups of `members` (each with an open group of the same length, `opened`)."""
        if opened[0] is not None:
            k = mx.concatenate([stack([pending[0] for pending in opened]), k], axis=1)
            s = mx.concatenate([stack([pending[1] for pending in opened]), s], axis=1)
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


def _rings_stack(stores: list, rows: int) -> bool:
    """Whether the stores' input rings stack: all of one shape, each with room for `rows`."""
    history = stores[0].history
    shapes = {(store.history, row_shape(store, "inputs")) for store in stores}
    return bool(history) and rows <= history and len(shapes) == 1 and \
        (history, None) not in shapes


def _put_stacked(stores: list, k: mx.array, s: mx.array, starts: tuple) -> None:
    """`remember_inputs` of every store in one update of their stacked rings (`_rings_stack`),
    which they share from then on."""
    batch, length = k.shape[:2]
    history = stores[0].history
    slots = (mx.array(starts)[:, None] + mx.arange(length)) % history
    rows = mx.put_along_axis(stacked_rows(stores, "inputs"), slots.reshape(batch, length, 1, 1),
                             mx.stack([k, s], axis=2), axis=1)
    share(stores, "inputs", rows)  # the next step finds them stacked
