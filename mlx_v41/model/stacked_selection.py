"""Top-k selection of several sequences at once, each against its own compressed rows
(a batched decode step: `model/batch.py`).

The sequences' packed index keys are padded to the longest and stacked; the index queries,
scores, visibility, candidate pool and top-k run over all of them together. A padded row lies
past every query's visible rows (a sequence holds exactly the rows its positions completed), so
it scores -inf and sorts after every real row (ties go to the lower row): each sequence's
first min(k, T) picks are its own `select_rows` result, and the stacked scores of its rows are
its own (each score is one dot product over the index dim; tests/test_batch.py).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from .indexer import NEG_INF, sort_key
from ..cache.stacked import stack_padded
from .stacked import split_rows
from .selection import Pool, Selection, _membership, _merge, finish
from ..numerics.quant import unpack_fp4_e8m0


def select_stacked(indexer, rope, x, qr, qr_fp8, packed_keys: mx.array, counts: list,
                   starts: tuple, ratio: int, topk: int, pool: Optional[Pool] = None) -> tuple:
    """`select_rows` of G sequences: query rows x [G, n, D] (low-rank queries qr, their
    act_fp8 qr_fp8) from positions starts[g] on, against the first counts[g] > 0 rows of
    packed_keys[g] ([G, max(counts), bytes]; the rows after them score -inf, never picked).
    `pool.member`, where given, is the list of each sequence's [1, n, blocks_g]. Returns
    (each sequence's `Selection`: rows [1, n, min(topk, T_g)], the candidate source's member
    [1, n, ceil(T_g / block)]; all rows [G, n, min(topk, max(counts))], each sequence's
    padded with -1: a padded row scores -inf, and -inf picks come last as -1)."""
    total, length = max(counts), x.shape[1]
    keys = unpack_fp4_e8m0(packed_keys)
    q, weights = indexer.queries(x, qr, starts, rope, qr_fp8)
    positions = mx.array((np.asarray(starts, np.int64)[:, None]
                          + np.arange(length)).astype(np.int32))              # [G, n]
    complete = (positions + 1) // ratio
    scores = indexer.block_scores(q, weights, keys)
    scores = mx.where(mx.arange(total) < complete[..., None], scores, NEG_INF)
    member = None
    if pool is not None and pool.member is None:
        member = _pool_members(scores, complete, pool)
    elif pool is not None:
        given = stack_padded(pool.member, False, axis=2)
        scores = mx.where(mx.repeat(given, pool.block, axis=-1)[..., :total], scores, NEG_INF)
    stacked = finish(_merge(None, sort_key(scores, 0), topk), total)
    members = [None] * len(counts)
    if member is not None:
        members = split_rows(member)
        members = [m[..., :-(-count // pool.block)] for m, count in zip(members, counts)]
    return [Selection(r[..., :min(topk, count)], m)
            for r, m, count in zip(split_rows(stacked), members, counts)], stacked


def _pool_members(scores, complete, pool: Pool) -> mx.array:
    """The candidate source's pool [G, n, blocks]: the `keep` blocks of the best visible
    score, the block holding the newest visible row pinned first (`_QueryBlock._pool_keys`)."""
    batch, length, total = scores.shape
    blocks = -(-total // pool.block)
    pad = blocks * pool.block - total
    if pad:
        scores = mx.pad(scores, [(0, 0), (0, 0), (0, pad)], constant_values=NEG_INF)
    block_max = mx.max(scores.reshape(batch, length, blocks, pool.block), axis=-1)
    newest = mx.where(complete > 0, (complete - 1) // pool.block, -1)
    pin = mx.arange(blocks) == newest[..., None]
    best = _merge(None, sort_key(mx.where(pin, float("inf"), block_max), 0), pool.keep)
    return _membership(finish(best, blocks), blocks)
