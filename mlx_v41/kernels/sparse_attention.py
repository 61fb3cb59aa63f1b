"""Sparse attention with sinks over a layer's sliding window and its selected compressed rows
(CSA2, the reference's `sparse_attn` kernel: fp32 scores and softmax, probabilities rounded to
bf16 before P.V, fp32 denominator with the per-head sink, running-max floor -1e30, bf16 output).

`sparse_attention_ops` gathers the window rows, gathers and dequantises the packed FP4 rows, and
runs the softmax on the result. The Metal kernel (metal/sparse_attention.metal) does one pass with
an online softmax over blocks of 64 keys, decoding each packed 288 B row on the fly, so neither
the gathered keys nor a dequantised copy of the cache is ever written to memory.
"""

from __future__ import annotations

import functools
from typing import Optional

import mlx.core as mx
import numpy as np

from ..numerics.quant import FP4_E4M3_BLOCK, pack_fp4_e4m3, unpack_fp4_e4m3
from .builder import device_buffer
from .check import assert_close
from .spec import KernelSpec

RUNNING_MAX_FLOOR = -1e30  # finite: a query with no keys yields 0, not NaN
MAX_HEAD_DIM = 512  # kernel limit: 16 channels per lane, SIMDGROUPS x D fp32 of threadgroup memory
SIMDGROUPS = 4
GATHER_BLOCK_ELEMENTS = 1 << 22  # gathered key values per block of query rows (ops path)


def packed_row_bytes(head_dim: int) -> int:
    """Bytes of one packed fp4_e4m3 row: head_dim/2 codes + head_dim/16 E4M3 scales."""
    return head_dim // 2 + head_dim // FP4_E4M3_BLOCK


@functools.lru_cache(maxsize=16)
def _window_slots(length: int, prefix: int, window_size: int):
    """(window row of each query's window slot, clamped to >= 0; is the slot filled), both
    [S, window_size], made on the host once per shape (no graph ops per layer). Query s sees
    rows prefix + s - window_size + 1 .. prefix + s."""
    newest = prefix + np.arange(length)
    rows = newest[:, None] - (window_size - 1) + np.arange(window_size)[None, :]
    return mx.array(np.maximum(rows, 0).astype(np.int32)), mx.array(rows >= 0)


@mx.compile
def _selected(picks: mx.array, total: mx.array, offsets: mx.array):
    """(is a real row, flat row index into [B * T] with empty picks at 0) of picks [B, S, K]."""
    present = (picks >= 0) & (picks < total)
    return present, mx.where(present, picks, 0) + offsets


def _gather_packed(packed_kv: mx.array, rows: mx.array, batch_rows=None):
    """(packed rows [B, S, K, P] of rows [B, S, K] (-1 / >= T empty: row 0), is filled);
    row b of `rows` reads batch row batch_rows[b] of packed_kv (default b)."""
    batch, total, width = packed_kv.shape
    own = np.arange(batch) if batch_rows is None else np.asarray(batch_rows)
    offsets = mx.array((own * total)[:, None, None].astype(np.int32))
    present, flat = _selected(rows, mx.array(total, dtype=rows.dtype), offsets)
    return packed_kv.reshape(batch * total, width)[flat], present


def attend(q, keys, valid, sinks, scale):
    """q [B, S, H, d], keys [B, S, N, d] (K = V), valid [B, S, N] -> [B, S, H, d] bf16.

    The probabilities are rounded to bf16 relative to the row's global max (not per block)."""
    return _compiled_attend(q, keys, valid, sinks, scale)


def _attend(q, keys, valid, sinks, scale):
    """q [B, S, H, d], keys [B, S, N, d] (K = V), valid [B, S, N] -> [B, S, H, d] bf16.

    The probabilities are rounded to bf16 relative to the row's global max (not per block)."""
    kf = keys.astype(mx.float32)
    z = (q.astype(mx.float32) @ kf.swapaxes(-1, -2)) * scale          # [B, S, H, N]
    z = mx.where(valid[:, :, None, :], z, float("-inf"))
    top = mx.maximum(mx.max(z, axis=-1, keepdims=True), RUNNING_MAX_FLOOR)
    p = mx.exp(z - top)
    denom = mx.sum(p, axis=-1, keepdims=True) + mx.exp(sinks[:, None] - top)
    out = (p.astype(mx.bfloat16).astype(mx.float32) @ kf) / denom
    return out.astype(mx.bfloat16)


_compiled_attend = mx.compile(_attend)


def sparse_attention_ops(q, window, packed_kv, rows, sinks, scale: float, window_size: int,
                         window_first=None):
    """Reference (pure MLX, gather then attend); arguments as in `sparse_attention`. Query
    rows go in blocks of about GATHER_BLOCK_ELEMENTS gathered key values, so a long prefill
    chunk never gathers all its keys at once (each row is computed independently)."""
    selected = rows.shape[-1] if packed_kv.shape[1] else 0

    def gathered(i, step):
        return _gather_packed(packed_kv, rows[:, i:i + step]) if selected else None

    return _attend_blocks(q, window, gathered, selected, sinks, scale, window_size,
                          window_first)


def gather_selected(packed_kv: mx.array, rows: mx.array, batch_rows=None):
    """(packed rows [B, S, K, P], is each filled [B, S, K]) of the selection `rows` [B, S, K]
    of `packed_kv` [G, T, P] (T > 0; row b reads batch row batch_rows[b], default b), as
    `sparse_attention_ops` gathers them: what `gathered_attention_ops` reads, so that
    sequences with caches of their own attend at once."""
    return _gather_packed(packed_kv, rows, batch_rows)


def gathered_attention_ops(q, window, selected, sinks, scale: float, window_size: int,
                           window_first=None):
    """`sparse_attention_ops` with each sequence's selected rows already gathered
    (`gather_selected`, then stacked): `selected` (packed [B, S, K, P], filled [B, S, K]) or
    None for no selected rows. Row for row the bits of `sparse_attention_ops` (ops only)."""
    width = 0 if selected is None else selected[0].shape[2]

    def gathered(i, step):
        return None if selected is None else (selected[0][:, i:i + step],
                                              selected[1][:, i:i + step])

    return _attend_blocks(q, window, gathered, width, sinks, scale, window_size,
                          window_first)


def _attend_blocks(q, window, gathered, selected: int, sinks, scale, window_size: int,
                   window_first=None):
    """Attention of q over the window and the `selected` rows that `gathered(i, step)` gives
    for query rows [i, i + step), block by block."""
    batch, length, _, dim = q.shape
    slots, filled = _window_slots(length, window.shape[1] - length, window_size)
    first = None if window_first is None else first_buffer(window_first, batch)[:, None, None]
    step = max(1, GATHER_BLOCK_ELEMENTS // max(1, batch * (window_size + selected) * dim))
    outs = []
    for i in range(0, max(length, 1), step):
        block = slots[i:i + step]
        # take: one gather (indexing `[:, block]` adds an arange and two index casts)
        keys = mx.take(window, block, axis=1)                             # [B, s, W, d]
        valid = mx.broadcast_to(filled[None, i:i + step], (batch,) + block.shape)
        if first is not None:  # rows before a batch row's first filled one are empty
            valid = valid & (block[None] >= first)
        if selected:
            packed, present = gathered(i, step)
            keys = mx.concatenate([keys, unpack_fp4_e4m3(packed, keys.dtype)], axis=2)
            valid = mx.concatenate([valid, present], axis=2)
        outs.append(attend(q[:, i:i + step], keys, valid, sinks, scale))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)


def heads_per_group(heads: int, head_dim: int) -> int:
    """Heads one threadgroup serves: each key row is decoded once for all of them; at most
    64 fp32 query and 64 accumulator registers per lane."""
    limit = max(1, 64 // (head_dim // 32))
    return next(h for h in (16, 8, 4, 2, 1) if h <= limit and heads % h == 0)


def first_buffer(window_first, batch: int, size: int = 0) -> mx.array:
    """The int32 first filled window row of each batch row (None: 0 for all), made on the
    host (no launch), zero-padded to `size` entries."""
    if window_first is None:
        return _zeros(max(batch, size))
    if isinstance(window_first, mx.array):
        window_first = window_first.tolist()
    values = np.zeros(max(batch, size), np.int32)
    values[:batch] = window_first
    return mx.array(values)


@functools.cache
def _zeros(size: int) -> mx.array:
    out = mx.zeros((size,), mx.int32)
    mx.eval(out)
    return out


def _launch(kernel, q, window, packed_kv, rows, sinks, scale, window_size, window_first=None,
            *, heads=None, simdgroups=SIMDGROUPS):
    batch, length, num_heads, dim = q.shape
    group = heads or heads_per_group(num_heads, dim)
    total, topk = packed_kv.shape[1], rows.shape[-1]
    # Every array input keeps >= 8 elements so it binds as `device` (MLX binds smaller
    # arrays as `constant`, a different kernel). Empty inputs become constant placeholders
    # that are never read; a short `rows` is padded with empty entries (no effect).
    if total == 0:
        packed_kv = _placeholder((1, 1, 8), mx.uint8)
    if topk == 0:
        rows = _placeholder((8,), mx.int32)
    elif rows.size < 8:
        pad = mx.full((batch, length, -(-8 // (batch * length)) - topk), -1, dtype=mx.int32)
        rows = mx.concatenate([rows.astype(mx.int32), pad], axis=-1)
        topk = rows.shape[-1]
    sinks = device_buffer(sinks)
    first = first_buffer(window_first, batch, 8)  # >= 8 elements: bound as `device`
    threads = 32 * simdgroups
    out, = kernel(
        inputs=[q, window, packed_kv, rows.astype(mx.int32), sinks, first, float(scale),
                int(window_size), int(total), int(topk)],
        template=[("HEAD_DIM", dim), ("HEADS_PER_GROUP", group), ("SIMDGROUPS", simdgroups)],
        grid=(threads * (num_heads // group), batch * length, 1),
        threadgroup=(threads, 1, 1), output_shapes=[q.shape], output_dtypes=[mx.bfloat16])
    return out


@functools.cache
def _placeholder(shape: tuple, dtype) -> mx.array:
    """An evaluated 8-element array standing in for an empty input (never read)."""
    out = mx.full(shape, -1, dtype=mx.int32).astype(dtype)
    mx.eval(out)
    return out


CHECK_TOLERANCE = 2.0 ** -6  # of the largest output: bf16-level (the per-block rounding of p)


def _probe(run, ops) -> None:
    """Two query rows over a window of 9 and 6 of 20 packed rows (empty picks included)."""
    wave = lambda n, f: mx.sin(mx.arange(n, dtype=mx.float32) * f)  # noqa: E731
    q = (wave(2 * 4 * 64, 0.13) * 2).reshape(1, 2, 4, 64).astype(mx.bfloat16)
    window = wave(9 * 64, 0.29).reshape(1, 9, 64).astype(mx.bfloat16)
    packed = pack_fp4_e4m3(wave(20 * 64, 0.47).reshape(1, 20, 64) * 2)
    rows = mx.array([[[0, 19, -1, 7, 3, 25], [2, -1, 11, 12, 19, -1]]], dtype=mx.int32)
    sinks = wave(4, 1.1)
    args = (q, window, packed, rows, sinks, 0.125, 8)
    assert_close("sparse_attention", run(*args), ops(*args), CHECK_TOLERANCE)


# The kernel as `run(q, window, packed_kv, rows, sinks, scale, window_size, window_first=None,
# *, heads=None, simdgroups=SIMDGROUPS)`: metal/sparse_attention.metal, one pass with an online
# softmax.
SPARSE_ATTENTION = KernelSpec(
    "v41_sparse_attention", "sparse_attention",
    ("q", "window", "packed", "rows", "sinks", "window_first", "scale", "window_size", "n_rows",
     "topk"),
    ("out",), "sparse_attention.metal", _launch, _probe, sparse_attention_ops,
    headers=("v41_common.h",))


def sparse_attention(q, window, packed_kv, rows, sinks, scale: float, window_size: int,
                     window_first=None, use_kernel: Optional[bool] = None, run=None):
    """Attention of a chunk's queries over their sliding window and selected compressed rows.

    Args:
        q: [B, S, H, d] bf16 queries (after RoPE).
        window: [B, P + S, d] bf16 window KV rows: the P most recent cached rows, then the
            chunk's S rows; query s attends rows [max(0, P + s - window_size + 1), P + s].
        packed_kv: [B, T, d/2 + d/16] uint8 packed fp4_e4m3 rows of the kv owner (T may be 0).
        rows: [B, S, K] int32 indices into packed_kv; -1 (or >= T) = empty (K may be 0).
        sinks: [H] fp32 per-head sink logits (denominator only).
        scale: score scale (head_dim ** -0.5).
        window_size: sliding-window length.
        window_first: per batch row, its first filled window row (B ints or an int array
            [B]; None: 0 for every row): the rows before it are empty. Sequences whose windows
            are still filling stack their windows padded at the front to one length P (zero
            rows, `window_rows` per row), and each query's entries stay those of its own call:
            the same bits as that call on the ops and on the kernel.
        use_kernel: use the Metal kernel when it applies.
        run: an already built kernel (`SPARSE_ATTENTION.build(factory)`) to use unconditionally,
            e.g. the Metal simulator's in tests.
    Returns:
        [B, S, H, d] bf16.
    """
    batch, length, num_heads, dim = q.shape
    if packed_kv.shape[-1] != packed_row_bytes(dim) or packed_kv.dtype != mx.uint8:
        raise ValueError(f"packed_kv must be uint8 rows of {packed_row_bytes(dim)} bytes for "
                         f"head_dim {dim}, got {packed_kv.dtype} {packed_kv.shape}")
    run = SPARSE_ATTENTION.choose(use_kernel, run, applies=(
        q.dtype == mx.bfloat16 and window.dtype == mx.bfloat16 and dim % 32 == 0
        and dim <= MAX_HEAD_DIM and q.size > 0 and window_size >= 1))
    if window_first is not None:
        check_window_first(window_first, batch, window.shape[1] - length)
    if run is None:
        return sparse_attention_ops(q, window, packed_kv, rows, sinks, scale, window_size,
                                    window_first)
    return run(q, window, packed_kv, rows, sinks, scale, window_size, window_first)


def check_window_first(window_first, batch: int, prefix: int) -> None:
    """One first filled row per batch row, each in [0, P] (P: the window rows before the
    call's own); else a one-line ValueError."""
    firsts = np.asarray(window_first.tolist() if isinstance(window_first, mx.array)
                        else window_first)
    if firsts.shape != (batch,) or not np.issubdtype(firsts.dtype, np.integer):
        raise ValueError(f"sparse_attention: window_first must be {batch} ints (one per batch "
                         f"row), got {firsts.dtype} of shape {firsts.shape}")
    if firsts.size and not (0 <= firsts.min() and firsts.max() <= prefix):
        raise ValueError(f"sparse_attention: window_first {firsts.tolist()} out of [0, {prefix}] "
                         f"(the window rows before the call's own)")
