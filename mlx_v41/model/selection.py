"""Top-k selection of an owner's compressed rows for a chunk of query rows, blocked over both
query rows and keys, so that a prefill scales to long contexts.

Each block of packed index keys is decoded once per chunk and scored against every block of
query rows; each query block keeps a running top-k that merges the block's candidates (and,
at the candidate source, a running top-n of its pool blocks). The merge orders by (score, then
the lower row) over global row numbers, a total order, so the result is the very set and order
of one top-k over all scores (`indexer.top_rows`). Nothing is evaluated here: the chunk's one
evaluation runs the blocks in order (each key block's decode waits on the previous block's
merges through `mx.depends`), so memory stays bounded and the number of evaluations per chunk
does not grow with the context.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from . import indexer as indexer_mod
from .indexer import INDEX_BITS, NEG_INF, sort_key
from ..kernels.context import settle
from ..numerics.quant import unpack_fp4_e8m0

ROW_MASK = (1 << INDEX_BITS) - 1
NEG_INF_ORDER = 0x7FFFFF  # sort-key score part of -inf (bits 0xFF800000, order-mapped)


@dataclass
class Pool:
    """The candidate pool of a query chunk: `member` [B, n, blocks] bool (a Reindex layer
    reads it) or, at the candidate source, the number of blocks to keep (`member` None)."""

    block: int
    member: Optional[mx.array] = None
    keep: int = 0


@dataclass
class Selection:
    rows: mx.array                      # [B, n, k] int32 ascending, -1 empty
    member: Optional[mx.array] = None   # candidate source: its pool [B, n, blocks] bool
    scores: Optional[mx.array] = None   # [B, n, T] bf16 masked scores (when asked for)


def select_rows(indexer, rope, x, qr, packed_keys, first: int, ratio: int, topk: int,
                budget: int, pool: Optional[Pool] = None, keep_scores: bool = False,
                qr_fp8=None):
    """Selection of the query rows x [B, n, D] (low-rank queries qr) at positions first..,
    against the packed index keys [B, T, bytes]. `budget`: query rows x heads x key rows
    scored at once. `qr_fp8`: qr
    already act_fp8-rounded as fp32 (`Indexer.queries`)."""
    total = packed_keys.shape[1]
    key_block = min(total, indexer_mod.KEY_BLOCK)
    if pool is not None:  # whole pool blocks per key block
        key_block = max(pool.block, key_block // pool.block * pool.block)
    step = max(1, budget // (indexer.n_heads * key_block))
    rows_of = pool.member if pool is not None else None
    blocks = [_QueryBlock(indexer, rope, x[:, i:i + step], qr[:, i:i + step], first + i,
                          None if rows_of is None else rows_of[:, i:i + step],
                          None if qr_fp8 is None else qr_fp8[:, i:i + step])
              for i in range(0, x.shape[1], step)]
    barrier = []
    for start in range(0, total, key_block):
        packed = packed_keys[:, start:start + key_block]
        keys = unpack_fp4_e8m0(mx.depends(packed, barrier) if barrier else packed)
        for block in blocks:
            block.score(indexer, keys, start, ratio, topk, pool, keep_scores)
            settle(block.state())  # a block at a time where evaluations are kept short
        barrier = [a for block in blocks for a in block.state()]
    return _joined(blocks, total, pool, keep_scores)


class _QueryBlock:
    """One block of query rows: its index queries and its running selection."""

    def __init__(self, indexer, rope, x, qr, first: int, pool_rows, qr_fp8=None):
        self.q, self.weights = indexer.queries(x, qr, first, rope, qr_fp8)
        settle(self.q, self.weights)
        self.pool_rows = pool_rows  # Reindex layer: the pool of these rows [B, s, blocks]
        self.positions = mx.arange(first, first + x.shape[1])
        self.best = None         # running top-k sort keys [B, s, <= k]
        self.best_blocks = None  # candidate source: running top pool-block keys
        self.scores = []

    def score(self, indexer, keys, start: int, ratio: int, topk: int, pool, keep: bool):
        width = keys.shape[1]
        scores = indexer.block_scores(self.q, self.weights, keys)
        scores = _visible(scores, mx.arange(start, start + width), self.positions, ratio)
        if pool is not None and pool.member is None:
            self.best_blocks = _merge(self.best_blocks, self._pool_keys(scores, start, ratio,
                                                                        pool.block), pool.keep)
        elif pool is not None:
            scores = mx.where(self.member_of(pool.block, start // pool.block, width), scores,
                              NEG_INF)
        self.best = _merge(self.best, sort_key(scores, start), topk)
        if keep:
            self.scores.append(scores)

    def member_of(self, block: int, first: int, width: int) -> mx.array:
        """The pool's row mask [B, s, width] over the key rows from first * block on."""
        part = self.pool_rows[..., first:first + -(-width // block)]
        return mx.repeat(part, block, axis=-1)[..., :width]

    def _pool_keys(self, scores, start: int, ratio: int, block: int) -> mx.array:
        """Sort keys of this key block's pool blocks: best visible score, the block holding
        the newest visible row pinned first (as `indexer.candidate_blocks`)."""
        batch, length, width = scores.shape
        n_blocks = -(-width // block)
        pad = n_blocks * block - width
        if pad:
            scores = mx.pad(scores, [(0, 0), (0, 0), (0, pad)], constant_values=NEG_INF)
        block_max = mx.max(scores.reshape(batch, length, n_blocks, block), axis=-1)
        complete = (self.positions + 1) // ratio
        newest = mx.where(complete > 0, (complete - 1) // block, -1)
        first = start // block
        pin = (first + mx.arange(n_blocks))[None, :] == newest[:, None]
        return sort_key(mx.where(pin[None], float("inf"), block_max), first)

    def state(self) -> list:
        return [a for a in (self.best, self.best_blocks) if a is not None]


def _merge(best, keys: mx.array, k: int) -> mx.array:
    """The k largest sort keys of the running set and a block's keys."""
    keys = keys if best is None else mx.concatenate([best, keys], axis=-1)
    k = min(k, keys.shape[-1])
    if keys.shape[-1] == k:
        return keys
    picks = mx.argpartition(-keys, k - 1, axis=-1)[..., :k]
    return mx.take_along_axis(keys, picks, axis=-1)


@functools.partial(mx.compile, shapeless=True)
def _visible(scores, rows, positions, ratio):
    """Scores of rows not yet complete at each query's position -> -inf."""
    seen = rows[None, :] < ((positions + 1) // ratio)[:, None]
    return mx.where(seen[None], scores, NEG_INF)


def finish(best: mx.array, total: int) -> mx.array:
    """Row indices [..., k] of the kept sort keys in ascending order, -inf picks as trailing
    -1 (`indexer.top_rows`'s output)."""
    total = mx.array(total, dtype=mx.int32)  # an array: a new total must not retrace
    return _unsorted_rows(mx.sort(_rows_of(best, total), axis=-1), total)


@functools.partial(mx.compile, shapeless=True)
def _rows_of(best, total):
    rows = (ROW_MASK - (best & ROW_MASK)).astype(mx.int32)
    return mx.where((best >> INDEX_BITS) == NEG_INF_ORDER, total, rows)


@functools.partial(mx.compile, shapeless=True)
def _unsorted_rows(rows, total):
    return mx.where(rows == total, -1, rows)


def _joined(blocks: list, total: int, pool: Optional[Pool], keep_scores: bool) -> Selection:
    def join(parts):
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)

    rows = join([finish(b.best, total) for b in blocks])
    member = None
    if pool is not None and pool.member is None:
        n_blocks = -(-total // pool.block)
        member = join([_membership(finish(b.best_blocks, n_blocks), n_blocks) for b in blocks])
    scores = None
    if keep_scores:
        scores = join([b.scores[0] if len(b.scores) == 1 else mx.concatenate(b.scores, axis=-1)
                       for b in blocks])
    return Selection(rows, member, scores)


def _membership(kept: mx.array, n_blocks: int) -> mx.array:
    """[B, s, n_blocks] bool of kept block indices (-1 empty lands in a dropped column)."""
    batch, length, _ = kept.shape
    member = mx.zeros((batch, length, n_blocks + 1), dtype=mx.bool_)
    slots = mx.where(kept >= 0, kept, n_blocks)
    return mx.put_along_axis(member, slots, mx.array(True), axis=-1)[..., :n_blocks]
