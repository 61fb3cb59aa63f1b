"""Sparse indexer: relu-scored top-k selection of compressed rows, and the candidate pool
(official inference/model.py `Indexer`). Scores are computed in bf16 like the reference; ties
go to the lower row.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn

from ..kernels.index_queries import index_queries
from .layers import Linear, QuantLinear, RMSNorm
from ..numerics.rope import RoPE

NEG_INF = float("-inf")
INDEX_BITS = 24  # row index bits in the tie-breaking sort key (16M rows)
KEY_BLOCK = 1 << 18  # index-key rows decoded at once (64 MiB of bf16 at index_head_dim 128)


class Indexer(nn.Module):
    def __init__(self, hidden, q_lora_rank, head_dim, n_heads, index_dim, owns_keys, eps):
        super().__init__()
        self.q_b_proj = QuantLinear(q_lora_rank, n_heads * index_dim)
        self.weights_proj = Linear(hidden, n_heads)
        if owns_keys:
            self.k_proj = Linear(head_dim, index_dim)
            self.k_norm = RMSNorm(index_dim, eps)
        self.n_heads, self.index_dim = n_heads, index_dim

    def keys(self, latents: mx.array, positions: mx.array, rope: RoPE) -> mx.array:
        """Index keys (RoPE'd, not yet FP4-rounded: the cache packs them) of new pre-RoPE
        latents [B, G, d] at their group positions."""
        return rope(self.k_norm(self.k_proj(latents)), positions)

    def queries(self, x, qr, positions, rope: RoPE, qr_fp8=None):
        """(FP4-rounded index queries [B, S, H, d], bf16 head weights [B, S, H, 1]) of query
        rows x [B, S, D] with low-rank queries qr at `positions`.
        `qr_fp8`: qr already act_fp8-rounded as fp32 (the attention's own `q_b_proj.prepare`,
        the same values), so the projection reads it instead of rounding qr again."""
        batch, length, _ = x.shape
        prepared = self.q_b_proj.prepare(qr) if qr_fp8 is None else qr_fp8
        products = self.q_b_proj.matmul(prepared)
        products = products.reshape(batch, length, self.n_heads, self.index_dim)
        q = index_queries(products, rope, positions)
        scale = (self.index_dim ** -0.5) * (self.n_heads ** -0.5)
        return q, (self.weights_proj(x) * scale).astype(mx.bfloat16)[..., None]

    def block_scores(self, q, weights, keys: mx.array) -> mx.array:
        """bf16 scores [B, S, T] of the queries against decoded index keys [B, T, d] (no
        masking)."""
        qk = mx.einsum("bshd,btd->bsht", q, keys)
        if qk.shape[2] == 1:  # MLX 0.32 crashes summing a size-1 axis in a shapeless compile
            return _weighted_relu_one(qk, weights)
        return _weighted_relu_sum(qk, weights)


def _weighted(qk: mx.array, weights: mx.array) -> mx.array:
    return (mx.maximum(qk.astype(mx.bfloat16), 0) * weights).astype(mx.bfloat16)


@functools.partial(mx.compile, shapeless=True)
def _weighted_relu_sum(qk: mx.array, weights: mx.array) -> mx.array:
    """Σ_heads bf16(relu(bf16(qk)) · w), summed in fp32, as bf16: one fused pass over the
    [B, S, H, T] products instead of four full-size intermediates."""
    return mx.sum(_weighted(qk, weights).astype(mx.float32), axis=2).astype(mx.bfloat16)


@functools.partial(mx.compile, shapeless=True)
def _weighted_relu_one(qk: mx.array, weights: mx.array) -> mx.array:
    """The same for one head: the sum's 0 + x (which turns -0 into +0), without the sum."""
    return (_weighted(qk, weights).astype(mx.float32) + 0.0).astype(mx.bfloat16)[:, :, 0]


def visible_rows(positions: mx.array, ratio: int, total: int) -> mx.array:
    """[S, T] mask: query at position i sees row t iff t < (i + 1) // ratio."""
    limit = (positions + 1) // ratio
    return mx.arange(total)[None, :] < limit[:, None]


def sort_key(scores: mx.array, first_row: int = 0) -> mx.array:
    """int64 key ordering by score, then by lower row index (the tie rule); the last axis
    holds rows first_row, first_row + 1, ..."""
    bits = _positive_zero(scores).view(mx.uint32)
    return _keyed(bits, mx.arange(first_row, first_row + scores.shape[-1], dtype=mx.int64))


@functools.partial(mx.compile, shapeless=True)
def _positive_zero(scores: mx.array) -> mx.array:
    return scores.astype(mx.float32) + 0.0  # -0 sorts as +0


@functools.partial(mx.compile, shapeless=True)
def _keyed(bits: mx.array, rows: mx.array) -> mx.array:
    bits = bits.astype(mx.int64)
    ordered = mx.where(bits >= 2 ** 31, 2 ** 32 - 1 - bits, bits + 2 ** 31)
    return ordered * (1 << INDEX_BITS) + ((1 << INDEX_BITS) - 1 - rows)


def top_rows(scores: mx.array, k: int) -> mx.array:
    """Indices [..., k] of the k best scores (lower index wins ties), in ascending order with
    -inf picks as trailing -1: the reference's order, which is the order attention sums the
    selected rows in, so the result does not depend on how many rows were scored."""
    total = scores.shape[-1]
    k = min(k, total)
    if k == 0:
        return mx.zeros(scores.shape[:-1] + (0,), dtype=mx.int32)
    ids = mx.argpartition(-sort_key(scores), k - 1, axis=-1)[..., :k].astype(mx.int32)
    picked = mx.take_along_axis(scores, ids, axis=-1)
    ids = mx.sort(mx.where(picked == NEG_INF, total, ids), axis=-1)
    return mx.where(ids == total, -1, ids)


def candidate_blocks(scores: mx.array, positions: mx.array, ratio: int, n_blocks: int,
                     block: int) -> mx.array:
    """Pool membership [B, S, ceil(T / block)] of each block of rows, from the candidate
    source's visible scores; a later Reindex layer expands it (`expand_blocks`)."""
    batch, length, total = scores.shape
    blocks = -(-total // block)
    pad = blocks * block - total
    padded = mx.pad(scores, [(0, 0), (0, 0), (0, pad)], constant_values=NEG_INF) if pad \
        else scores
    block_max = mx.max(padded.reshape(batch, length, blocks, block), axis=-1)
    complete = (positions + 1) // ratio
    newest = mx.where(complete > 0, (complete - 1) // block, -1)        # -1: no block yet
    pin = mx.arange(blocks)[None, :] == newest[:, None]
    block_max = mx.where(pin[None], float("inf"), block_max)
    kept = top_rows(block_max, n_blocks)                                # [B, S, <=n_blocks]
    # Empty picks (-1) land in a spare column that is dropped.
    member = mx.zeros((batch, length, blocks + 1), dtype=mx.bool_)
    slots = mx.where(kept >= 0, kept, blocks)
    return mx.put_along_axis(member, slots, mx.array(True), axis=-1)[..., :blocks]


def expand_blocks(member: mx.array, block: int, total: int) -> mx.array:
    """Block membership [B, S, blocks] -> row mask [B, S, total]."""
    return mx.repeat(member, block, axis=-1)[..., :total]

