"""The routed experts' (token, expert) pairs in expert order, the form `gather_qmm`'s sorted
path reads (mlx-lm's SwitchGLU sorts the same way): each pair's token row, id and weight in
the stable order of the ids, and each pair's place in it (to put the products back).

The ops take six launches for this (two argsorts, a division and three gathers); the Metal
kernel (metal/moe_order.metal) takes one, whatever the number of pairs: one threadgroup per
pair counts the pairs that go before it (O(P) each, so it serves up to `MAX_PAIRS` pairs, a
batched decode step or a short prefill piece; longer pieces take the ops) and copies its row.
It is a permutation: its outputs are the ops' bits.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from .check import assert_equal
from .spec import KernelSpec

MAX_PAIRS = 8192  # the kernel's limit: P threadgroups each reading every pair's id
_THREADS = 64     # per threadgroup (a multiple of the SIMD width, 32)


def moe_order_ops(ids: mx.array, weights: mx.array, x: mx.array, top_k: int) -> tuple:
    """Reference: (rows [P, D], sorted ids [P], sorted weights [P], place [P] uint32) for pairs
    `ids` / `weights` [P] over token rows `x` [P / top_k, D] (pure MLX)."""
    order = mx.argsort(ids)  # stable: equal experts keep pair order
    return x[order // top_k], ids[order], weights[order], mx.argsort(order)


def _check(ids: mx.array, weights: mx.array, x: mx.array, top_k: int) -> None:
    if ids.ndim != 1 or weights.shape != ids.shape or x.ndim != 2 \
            or x.shape[0] * top_k != ids.shape[0]:
        raise ValueError(f"moe_order: ids {ids.shape} and weights {weights.shape} do not fit "
                         f"{top_k} experts for each of the rows {x.shape}")


def _launch(kernel, ids: mx.array, weights: mx.array, x: mx.array, top_k: int) -> tuple:
    _check(ids, weights, x, top_k)
    pairs, width = ids.shape[0], x.shape[1]
    return tuple(kernel(
        inputs=[ids.astype(mx.uint32), weights, x], template=[("K", top_k)],
        grid=(_THREADS * pairs, 1, 1), threadgroup=(_THREADS, 1, 1),
        output_shapes=[(pairs, width), (pairs,), (pairs,), (pairs,)],
        output_dtypes=[x.dtype, mx.uint32, weights.dtype, mx.uint32]))


def _probe(run, ops) -> None:
    """Five tokens' top 6 over 7 experts (ties across tokens): the ops' bits."""
    ids = (mx.arange(30, dtype=mx.uint32) * 5) % 7
    weights = mx.sin(mx.arange(30, dtype=mx.float32))
    x = mx.cos(mx.arange(5 * 64, dtype=mx.float32) * 0.3).reshape(5, 64)
    for name, got, want in zip(("rows", "ids", "weights", "place"), run(ids, weights, x, 6),
                               ops(ids, weights, x, 6)):
        assert_equal(f"moe_order {name}", got, want)


# The kernel as `run(ids, weights, x, top_k)`: metal/moe_order.metal, a threadgroup per pair.
MOE_ORDER = KernelSpec("v41_moe_order", "moe_order", ("ids", "weights", "x"),
                       ("rows", "sorted_ids", "sorted_weights", "place"), "moe_order.metal",
                       _launch, _probe, moe_order_ops)


def moe_order(ids: mx.array, weights: mx.array, x: mx.array, top_k: int,
              use_kernel: Optional[bool] = None, run=None) -> tuple:
    """The pairs in expert order.

    Args:
        ids: [P] uint32 expert of each pair; pair t * top_k + j is token t's j-th expert.
        weights: [P] the pairs' weights (any float dtype).
        x: [P / top_k, D] the tokens' rows.
        use_kernel: use the Metal kernel when it applies (1 to `MAX_PAIRS` pairs).
        run: an already built kernel (`MOE_ORDER.build(factory)`) to use where it applies,
            e.g. the Metal simulator's in tests.
    Returns:
        (rows [P, D], sorted ids [P] uint32, sorted weights [P], place [P] uint32): `x`'s row,
        id and weight of each pair in the stable order of the ids, and each pair's place in
        that order (`sorted[place]` is the pairs' own order again); the ops' bits.
    """
    _check(ids, weights, x, top_k)
    applies = 0 < ids.shape[0] <= MAX_PAIRS
    run = MOE_ORDER.choose(use_kernel, run, applies)
    if run is None or not applies:
        return moe_order_ops(ids, weights, x, top_k)
    return run(ids, weights, x, top_k)
