"""CSA2 attention of one layer: low-rank query, FP8 sliding-window KV, and for ratio > 0 the
global branch (compressor + indexer for Full layers, indexer only for Reindex, the owner's
selection for Reuse), sparse attention with sinks, inverse RoPE, grouped output
(official inference/model.py L700–789).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from ..cache.layer import LayerCache, append_stacked, stacked_packed
from ..cache.stacked import share, stack_padded, stacked as stacked_rows
from .compressor import Compressor
from .config import TextConfig
from .shared import BatchState, ForwardState
from .indexer import Indexer
from . import indexer as indexer_mod
from .selection import Pool, select_rows
from .stacked_selection import select_stacked
from .schedule import FULL, LayerRole
from .stacked import in_order, split_rows, stack, take_rows
from .layers import QuantLinear, RMSNorm, allocate_quantized, batch_rows
from .paired import paired_matmul
from ..kernels.act_fp8 import ACT_FP8
from ..kernels.context import settle
from ..kernels.fp4_pack import FP4_PACK, fp4_pack
from ..kernels.index_queries import INDEX_QUERIES
from ..kernels.norm import NORM, norm
from ..kernels.rope_products import ROPE_PRODUCTS, rope_products
from ..kernels.sparse_attention import (SPARSE_ATTENTION, gather_selected,
                                        gathered_attention_ops, packed_row_bytes,
                                        sparse_attention)
from ..kernels.spec import runs_ops
from ..kernels.swa_ring import SWA_RING_UPDATE, swa_ring_update
from ..kernels.window_rows import WINDOW_ROWS, window_rows
from ..numerics.rope import shared_rope

# Query rows x index heads x key rows scored at once: 16 MiB of fp32 per intermediate. A
# block is at least one query row against one key block, so at the real widths and long
# contexts (32 index heads x KEY_BLOCK = 2^18 rows) a block is one row and 32 MiB.
SCORE_BLOCK_ELEMENTS = 1 << 22


class GroupedLinear(nn.Module):
    """Block-diagonal `wo_a`: group g maps its heads' outputs through its own packed weight."""

    def __init__(self, groups: int, input_dims: int, output_dims: int, mode: str = "mxfp8",
                 bits: int = 8, group_size: int = 32):
        super().__init__()
        allocate_quantized(self, (groups,), output_dims, input_dims, mode, bits, group_size)

    def __call__(self, x: mx.array, products: bool = False) -> mx.array:
        """x [..., G, K] -> [..., G, N]; bf16 values in, no activation rounding (reference);
        bf16 out, or with `products` the fp32 products before that rounding."""
        groups = self.weight.shape[0]
        ids = mx.broadcast_to(batch_rows((groups,)), x.shape[:-1])
        out = mx.gather_qmm(x[..., None, :].astype(mx.float32), self.weight, self.scales,
                            self.get("biases"), lhs_indices=batch_rows(x.shape[:-1]),
                            rhs_indices=ids, transpose=True,
                            group_size=self.group_size, bits=self.bits, mode=self.mode)
        out = out.squeeze(-2)
        return out if products else out.astype(mx.bfloat16)


def add_projections(module: nn.Module, cfg: TextConfig) -> None:
    """The projections every attention has (backbone and DSpark): low-rank query, shared KV
    with its norm, grouped output, per-head sinks."""
    d, h, eps = cfg.head_dim, cfg.num_attention_heads, cfg.rms_norm_eps
    module.q_a_proj = QuantLinear(cfg.hidden_size, cfg.q_lora_rank)
    module.q_a_norm = RMSNorm(cfg.q_lora_rank, eps)
    module.q_b_proj = QuantLinear(cfg.q_lora_rank, h * d)
    module.kv_proj = QuantLinear(cfg.hidden_size, d)
    module.kv_norm = RMSNorm(d, eps)
    module.o_a_proj = GroupedLinear(cfg.o_groups, h * d // cfg.o_groups, cfg.o_lora_rank)
    module.o_b_proj = QuantLinear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size)
    module.sinks = mx.zeros((h,), dtype=mx.float32)


class Attention(nn.Module):
    paired = ("kv_proj", "q_a_proj")  # one matmul over both weights (paired.py)

    def __init__(self, cfg: TextConfig, role: LayerRole):
        super().__init__()
        d, h, eps = cfg.head_dim, cfg.num_attention_heads, cfg.rms_norm_eps
        add_projections(self, cfg)
        if role.has_compressor:
            self.compressor = Compressor(cfg.hidden_size, d, role.ratio, eps)
        if role.has_indexer:
            self.indexer = Indexer(cfg.hidden_size, cfg.q_lora_rank, d, cfg.index_n_heads,
                                   cfg.index_head_dim, role.owns_index_k, eps)
        if role.ratio > 0:
            scaling = tuple(sorted(cfg.rope_scaling.items()))
            self.rope = shared_rope(cfg.qk_rope_head_dim, cfg.compress_rope_theta, scaling)
        else:
            self.rope = shared_rope(cfg.qk_rope_head_dim, cfg.rope_theta)
        self.role, self.heads, self.head_dim = role, h, d
        self.window, self.topk = cfg.sliding_window, cfg.index_topk
        self.pool_blocks, self.pool_block = cfg.candidate_topk_blocks, cfg.candidate_block_size

    def __call__(self, x: mx.array, ctx: ForwardState, cache: LayerCache,
                 n_out: Optional[int] = None, products: bool = False,
                 prepared: Optional[mx.array] = None) -> mx.array:
        """x [B, n_in, D]: attention inputs of the last n_in positions of the call. All n_in
        rows get window KV; only the last `n_out` rows (default all) are queries. Output bf16,
        or with `products` the fp32 products of `o_b_proj` before that rounding (`expand`
        rounds them in its own fused kernel). `prepared`: x's act_fp8 (fp32) when the caller
        has it (the fused attention-input norm), else computed here."""
        batch, n_in, _ = x.shape
        n_out = n_in if n_out is None else n_out
        xq = self.kv_proj.prepare(x) if prepared is None else prepared  # q_a's input too
        # one matmul for both where q_a reads every row, the same bits (paired.py)
        kv_products, qr = paired_matmul(self.kv_proj, self.q_a_proj, xq, n_out)
        # q_a_norm and its act_fp8: q_b_proj's input, which the indexer's q_b reads too
        qr, qr_fp8 = norm(qr, self.q_a_norm.weight, self.q_a_norm.eps, products=True,
                          outputs=("y", "fp8"))
        q = self.q_b_proj.matmul(qr_fp8).reshape(batch, n_out, self.heads, self.head_dim)
        settle(kv_products, q, qr, qr_fp8)
        if isinstance(ctx, BatchState):  # each sequence's rows against its own cache
            out = self._attend_batch(x, kv_products, q, qr, qr_fp8, ctx, cache, n_out)
        else:
            out = self._attend(x, kv_products, q, qr, qr_fp8, ctx, cache, n_out)
        settle(out)
        groups = self.o_a_proj.weight.shape[0]
        out = self.o_a_proj(out.reshape(batch, n_out, groups, -1), products=True)
        out = self.o_b_proj.prepare(out.reshape(batch, n_out, -1), True)
        return self.o_b_proj.matmul(out) if products else self.o_b_proj.apply(out)

    def _attend(self, x, kv_products, q, qr, qr_fp8, ctx: ForwardState, cache: LayerCache,
                n_out: int) -> mx.array:
        """The part of attention that reads and writes one sequence's cache: window KV
        (written to the ring), the compressor, RoPE of the queries, the selection, sparse
        attention and inverse RoPE -> [B, n_out, heads, head_dim] fp32."""
        n_in = x.shape[1]
        # kv_norm -> RoPE -> act_fp8 (bf16): the window KV (one launch where fused)
        kv, = norm(kv_products, self.kv_norm.weight, self.kv_norm.eps, products=True,
                   rope=self.rope, positions=ctx.end - n_in, outputs=("fp8",),
                   fp8_dtype=mx.bfloat16)
        window = self._window(kv, cache, ctx, n_out)
        cache.window.write(kv, ctx.end - n_in)
        if self.role.mode == FULL and self.role.layer not in ctx.precompressed:
            self.compress(x, ctx)
        x = x[:, n_in - n_out:]
        pos = ctx.end - n_out
        q = rope_products(q, self.rope, pos)  # bf16 rounding and RoPE (one launch)
        packed, rows = self._packed_rows(x, qr, qr_fp8, ctx)
        settle(q, window, packed, rows)
        out = sparse_attention(q, window, packed, rows, self.sinks, self.head_dim ** -0.5,
                               self.window)
        # fp32 between the kernels, each value still a bf16 one: every rounding the reference
        # makes happens inside the fused kernel that reads it, not as a cast of its own.
        return self.rope(out, pos, inverse=True, dtype=mx.float32)

    def _attend_batch(self, x, kv_products, q, qr, qr_fp8, ctx: BatchState, caches: list,
                      n_out: int) -> mx.array:
        """`_attend` of each sequence of a batch: those whose window rows all come from a
        full ring at once (`_attend_stacked`), the others one by one."""
        stacked = self._stackable(caches, x.shape[1], n_out)
        parts = []
        if stacked:
            parts.append(self._attend_stacked(
                *(take_rows(a, stacked) for a in (x, kv_products, q, qr, qr_fp8)),
                [ctx.states[b] for b in stacked], [caches[b] for b in stacked], ctx))
        alone = [b for b in range(len(caches)) if b not in set(stacked)]
        parts += [self._attend(x[b:b + 1], kv_products[b:b + 1], q[b:b + 1], qr[b:b + 1],
                               qr_fp8[b:b + 1], ctx.states[b], caches[b], n_out)
                  for b in alone]
        return in_order(parts, stacked + alone)

    # False: the stacked path runs wherever kernels run too (each kernel takes a position per
    # batch row); True: only where every dispatcher runs its ops (the path before that).
    stack_on_ops_only = False

    def _stackable(self, caches: list, n_in: int, n_out: int) -> list:
        """The sequences `_attend_stacked` takes: every row a query, and a ring with room for
        the call's rows (windows full or still filling alike). Its dispatchers are the ones
        `_attend` calls, with a position per batch row, so each row gets the values of its own
        call on the ops and on the kernels alike."""
        if n_out != n_in or (self.stack_on_ops_only and not runs_ops(*STACKED_OPS)):
            return []
        return [b for b, cache in enumerate(caches)
                if cache.window.allocated and n_in <= cache.window.capacity]

    def _attend_stacked(self, x, kv_products, q, qr, qr_fp8, states: list, caches: list,
                        ctx: BatchState) -> mx.array:
        """`_attend` of G sequences [G, n, ...]: the norms, RoPE, window reads and ring writes
        and the attention run over all G rows at once (one call of each dispatcher, each row
        its own positions and ring; a window still filling is padded at the front to
        window - 1 rows, which the attention leaves out), the compressor and the selection
        per sequence where their shapes differ (each against its own compressed rows)
        -> [G, n, heads, head_dim] fp32."""
        starts = tuple(state.start for state in states)
        held = self.window - 1
        first = tuple(max(0, held - start) for start in starts) if min(starts) < held else None
        kv, = norm(kv_products, self.kv_norm.weight, self.kv_norm.eps, products=True,
                   rope=self.rope, positions=starts, outputs=("fp8",), fp8_dtype=mx.bfloat16)
        rings = [cache.window for cache in caches]
        stacked = stacked_rows(rings, "rows")  # kept stacked from the last step where it can
        window = window_rows(stacked, kv, starts, held)
        _wrote_rows(rings, swa_ring_update(stacked, kv, starts), starts, kv.shape[1])
        each = _Split(x, qr, qr_fp8)
        if self.role.mode == FULL:
            self._compress_stacked(x, states)
        q = rope_products(q, self.rope, starts)
        scale = self.head_dim ** -0.5
        if SPARSE_ATTENTION.choose() is not None:  # the kernel: every sequence in one launch
            packed, rows = self._selection_padded(x, qr, qr_fp8, each, states, ctx)
            out = sparse_attention(q, window, packed, rows, self.sinks, scale, self.window,
                                   first)
            return self.rope(out, starts, inverse=True, dtype=mx.float32)
        outs, order = [], []
        for members, picked in self._selected_groups(x, qr, qr_fp8, each, states, ctx):
            outs.append(gathered_attention_ops(
                take_rows(q, members), take_rows(window, members), picked, self.sinks, scale,
                self.window, None if first is None else [first[b] for b in members]))
            order += members
        out = in_order(outs, order)
        return self.rope(out, starts, inverse=True, dtype=mx.float32)

    def _selection_padded(self, x, qr, qr_fp8, each: "_Split", states: list,
                          ctx: BatchState) -> tuple:
        """(packed rows [G, T, bytes], selection [G, n, K]) of every stacked sequence for the
        sparse-attention kernel: the owner's rows of every sequence as they are kept stacked
        (T >= each count; once per owner and call), each sequence's picks padded with -1 to
        the widest. The kernel walks a row's
        window entries, then its picks in order, in blocks of 64, and an empty entry adds
        exactly nothing to its running max, sum and accumulator, so each row gets the bits of
        its own call; the ops cannot pad (their sums run over every key): `_selected_groups`."""
        role, length = self.role, x.shape[1]
        width = packed_row_bytes(self.head_dim)
        if role.ratio == 0:
            return (mx.zeros((len(states), 0, width), mx.uint8),
                    mx.zeros((len(states), length, 0), mx.int32))
        source = role.layer if role.has_indexer else role.topk_owner
        ids = tuple(map(id, states))
        key = ("padded", role.kv_owner, source, ids)
        if key not in ctx.selected:
            stores = [state.shared[role.kv_owner].store for state in states]
            picks = ctx.selected.get(("picks", source, ids))  # select_stacked's, -1 padded
            if picks is None:
                selections = self._stacked_rows(x, qr, qr_fp8, each, states, ctx)
                picks = ctx.selected.get(("picks", source, ids))
                if picks is None:  # selected one by one
                    picks = stack_padded([p if store.count else mx.zeros((1, length, 0),
                                                                         mx.int32)
                                          for p, store in zip(selections, stores)], -1, axis=2)
            ctx.selected[key] = (self._owner_rows(stores, ctx, ids), picks)
        return ctx.selected[key]

    def _owner_rows(self, stores: list, ctx: BatchState, ids: tuple) -> mx.array:
        """The kv owner's packed rows of the stacked sequences [G, T, bytes], once per call
        (kept stacked from the step before where they can be, `stacked_packed`)."""
        owner = ("packed", self.role.kv_owner, ids)
        if owner not in ctx.selected:
            ctx.selected[owner] = stacked_packed(stores, "kv", packed_row_bytes(self.head_dim))
        return ctx.selected[owner]

    def _compress_stacked(self, x: mx.array, states: list) -> None:
        """`compress` of each stacked sequence: the compressor over all of them at once
        (`Compressor.stacked`), then the new rows' index keys, RoPE and packing for all of
        them at once where each has as many contiguous new rows (a decode step: one or none)."""
        ratio = self.role.ratio
        stores = [state.shared[self.role.layer].store for state in states]
        made = [(members, latents, firsts) for members, latents, firsts in
                self.compressor.stacked(x, stores, tuple(state.start for state in states))
                if latents.shape[1]]
        widths = {latents.shape[1] for _, latents, _ in made}
        if not made:
            return
        if len(widths) > 1 or (ratio > 1 and widths != {1}):
            for members, latents, firsts in made:  # one by one, as `compress` does
                for g, rows, first in zip(members, split_rows(latents), firsts):
                    self._append(stores[g], rows, first)
            return
        latents = stack([latents for _, latents, _ in made])
        starts = tuple(first * ratio for _, _, firsts in made for first in firsts)
        kv = fp4_pack(self.rope(latents, starts), "kv")
        index = fp4_pack(self.indexer.keys(latents, starts, self.rope), "index")
        append_stacked(stores, [g for members, _, _ in made for g in members], kv, index)

    def _selected_groups(self, x, qr, qr_fp8, each: "_Split", states: list,
                         ctx: BatchState) -> list:
        """[(sequences, their stacked selected rows as `gathered_attention_ops` reads them, or
        None)]: the sequences grouped by how many rows they select (a row's sums must run over
        as many keys as alone: no padding). Layers that read the same owner's rows with the
        same selection share them within the call."""
        role = self.role
        if role.ratio == 0:
            return [(list(range(len(states))), None)]
        source = role.layer if role.has_indexer else role.topk_owner
        key = (role.kv_owner, source, tuple(map(id, states)))
        if key not in ctx.selected:
            rows = self._stacked_rows(x, qr, qr_fp8, each, states, ctx)
            stores = [state.shared[role.kv_owner].store for state in states]
            groups: dict = {}
            for g, (store, picks) in enumerate(zip(stores, rows)):
                groups.setdefault(picks.shape[-1] if store.count else 0, []).append(g)
            ctx.selected[key] = [(members, None if width == 0 else gather_selected(
                self._owner_rows(stores, ctx, key[2]), stack([rows[g] for g in members]),
                members)) for width, members in groups.items()]  # one gather per width
        return ctx.selected[key]

    def _stacked_rows(self, x, qr, qr_fp8, each: "_Split", states: list,
                      ctx: BatchState) -> list:
        """Each sequence's selection [1, n, k] for the stacked rows: an index layer's own
        (`select_stacked` where every sequence has rows to select from, else one by one),
        or the index layer's it reuses. `select_stacked`'s stacked rows, each sequence's
        picks padded with -1 to the widest, go to `ctx.selected` for the kernel."""
        role, n = self.role, x.shape[1]
        shared = [state.shared[role.kv_owner] for state in states]
        if not role.has_indexer:
            return [s.selections[role.topk_owner][:, -n:] for s in shared]
        pool = None
        if role.is_candidate_source:
            pool = Pool(self.pool_block, keep=self.pool_blocks)
        elif role.uses_candidates and shared[0].pool is not None:
            pool = Pool(self.pool_block, member=[s.pool[:, -n:] for s in shared])
        counts = [s.store.count for s in shared]
        if (min(counts) == 0 or max(counts) > indexer_mod.KEY_BLOCK
                or states[0].compat_index_k_source is not None):
            return [self._global_rows(each.x(g), each.qr(g), each.qr_fp8(g), state)
                    for g, state in enumerate(states)]
        stores = [s.store for s in shared]
        keys = stacked_packed(stores, "index_k", stores[0].index_k.shape[-1])
        picked, padded = select_stacked(self.indexer, self.rope, x, qr, qr_fp8,
                                        keys[:, :max(counts)], counts,
                                        tuple(state.end - n for state in states), role.ratio,
                                        self.topk, pool)
        ctx.selected[("picks", role.layer, tuple(map(id, states)))] = padded
        for s, p in zip(shared, picked):
            if p.member is not None:
                s.pool = p.member
            s.selections[role.layer] = p.rows
        return [p.rows for p in picked]

    def _window(self, kv, cache: LayerCache, ctx: ForwardState, n_out: int) -> mx.array:
        """Window rows for the last n_out queries: [B, P + n_out, d], query s attending rows
        up to P + s. Rows before the call come from the ring, unless the call's first rows
        were skipped (then no query needs them) or the window is truncated (bounded replay)."""
        first, keep = ctx.end - kv.shape[1], n_out + self.window - 1
        if first == ctx.start and not ctx.truncate_window:
            return cache.window.with_recent(kv, first, keep)
        return kv[:, max(0, kv.shape[1] - keep):]

    def _packed_rows(self, x, qr, qr_fp8, ctx: ForwardState):
        """The kv owner's packed rows [B, T, bytes] and this layer's selection [B, n, k]."""
        batch, n = x.shape[:2]
        if self.role.ratio == 0:
            return mx.zeros((batch, 0, packed_row_bytes(self.head_dim)), mx.uint8), \
                mx.zeros((batch, n, 0), mx.int32)
        owner = ctx.shared[self.role.kv_owner].store
        rows = self._global_rows(x, qr, qr_fp8, ctx)
        packed = owner.packed_rows() if owner.count else \
            mx.zeros((batch, 0, packed_row_bytes(self.head_dim)), mx.uint8)
        return packed, rows

    def _global_rows(self, x, qr, qr_fp8, ctx: ForwardState) -> mx.array:
        """Selected compressed rows [B, n, k] of the owner's cache for the n query rows
        (`qr_fp8`: qr's act_fp8, the index queries' projection input)."""
        role, n = self.role, x.shape[1]
        shared = ctx.shared[role.kv_owner]
        if not role.has_indexer:
            return shared.selections[role.topk_owner][:, -n:]
        owner = shared.store
        if owner.count == 0:
            rows = mx.zeros((x.shape[0], n, 0), dtype=mx.int32)
        else:
            pool = None
            if role.is_candidate_source:
                pool = Pool(self.pool_block, keep=self.pool_blocks)
            elif role.uses_candidates and shared.pool is not None:
                pool = Pool(self.pool_block, member=shared.pool[:, -n:])
            picked = select_rows(self.indexer, self.rope, x, qr, self._index_keys(ctx, owner),
                                 ctx.end - n, role.ratio, self.topk, SCORE_BLOCK_ELEMENTS, pool,
                                 keep_scores=ctx.capturing, qr_fp8=qr_fp8)
            rows = picked.rows
            if picked.member is not None:
                shared.pool = picked.member
            if picked.scores is not None:
                ctx.record(f"layers.{role.layer}.indexer.score", picked.scores)
        ctx.record(f"layers.{role.layer}.indexer.topk", rows)
        rows = self._teacher_forced(ctx, shared, rows)
        shared.selections[role.layer] = rows
        return rows

    def _teacher_forced(self, ctx: ForwardState, shared, rows: mx.array) -> mx.array:
        """The given selection (and candidate pool) instead of this layer's own, when the
        forward is teacher-forced (block-isolated parity)."""
        teacher = None if ctx.probe is None else ctx.probe.teacher
        layer, n = self.role.layer, rows.shape[1]
        if teacher is None:
            return rows
        if layer in teacher.pool:
            shared.pool = teacher.pool[layer][:, -n:]
        return teacher.topk[layer][:, -n:] if layer in teacher.topk else rows

    def _index_keys(self, ctx: ForwardState, owner) -> mx.array:
        """Own packed index keys; with the compat switch, the reference's stale index-key
        handle at decode (docs/correctness.md, "Deviations from the reference")."""
        role, source = self.role, ctx.compat_index_k_source
        stale = (source is not None and role.owns_index_k and role.ratio > 1
                 and ctx.end - ctx.start == 1 and ctx.start % 2 == 0)
        if stale:
            return ctx.shared[source].store.packed_index_keys(owner.count)
        return owner.packed_index_keys()

    def compress(self, x, ctx: ForwardState) -> None:
        """Append the owner's global rows for the call's positions (x covers all of them)."""
        store = ctx.shared[self.role.layer].store
        latents, first = self.compressor(x, store, ctx.start)
        if latents.shape[1]:
            self._append(store, latents, first)

    def _append(self, store, latents: mx.array, first: int) -> None:
        """Store new compressed rows (groups from `first` on) with their index keys, both
        RoPE'd at their groups' positions."""
        group_pos = (first + mx.arange(latents.shape[1])) * self.role.ratio
        index_rows = self.indexer.keys(latents, group_pos, self.rope)
        store.append(self.rope(latents, group_pos), index_rows)


# The dispatchers `_attend_stacked` calls over stacked rows (with `stack_on_ops_only`, it runs
# only where all of them run their ops, `runs_ops`).
STACKED_OPS = (NORM, ACT_FP8, WINDOW_ROWS, SWA_RING_UPDATE, ROPE_PRODUCTS, SPARSE_ATTENTION,
               FP4_PACK, INDEX_QUERIES)


class _Split:
    """Per-sequence rows [1, ...] of stacked inputs, split once on first use."""

    def __init__(self, *arrays):
        self._arrays, self._parts = arrays, {}

    def _part(self, i: int, g: int) -> mx.array:
        if i not in self._parts:
            a = self._arrays[i]
            self._parts[i] = split_rows(a)
        return self._parts[i][g]

    def x(self, g):
        return self._part(0, g)

    def qr(self, g):
        return self._part(1, g)

    def qr_fp8(self, g):
        return self._part(2, g)


def _wrote_rows(rings: list, stacked: mx.array, starts: tuple, length: int) -> None:
    """The rings share the stacked ring (each its row) after `length` rows were written at
    each one's start: the next step finds them stacked."""
    share(rings, "rows", stacked)
    for ring, start in zip(rings, starts):
        ring.advanced(start, length)
