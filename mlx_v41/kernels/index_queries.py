"""Indexer queries from their projection's fp32 products: the bf16 rounding of the indexer's
`q_b_proj` output, RoPE on the trailing `qk_rope_head_dim` channels of every head, then FP4
E2M1 fake-quant with a power-of-two scale per 32 (official inference/model.py `Indexer.forward`:
`fp4_act_quant` of the rotated queries).

The ops (`index_queries_ops`: a cast, RoPE's fused rotation, the compiled `fp4_e8m0_qdq`) are 3
to 4 launches per indexer layer; the Metal kernel (metal/index_queries.metal) is one, with the
angles of `RoPE.cos_sin` (per-row first positions of a batch: `rope_products.angles_of`'s
[B * S] table, as rope_products.py describes). Its rotation makes the ops' fp32 products and
sums and its quantisation is exact, so it equals the ops wherever the compiler keeps each
product rounded on its own; a fused multiply-add may move a rotated value by one bf16 rounding,
and the FP4 rounding can turn that into one E2M1 step of its block's scale: CHECK_TOLERANCE.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from ..numerics.quant import FP4_E8M0_BLOCK, fp4_e8m0_qdq
from ..numerics.rope import RoPE
from .builder import simd_threadgroup
from .check import KernelMismatch, assert_close
from .rope_products import angles_of, applies, check_row_count, ops_positions, probe_input
from .spec import KernelSpec

# Of the largest output: one E2M1 step (at most 2/3 of its block's largest value, between 4 s
# and 6 s) that a fused multiply-add's bf16 rounding may flip, with a margin; through the
# simulator the kernel equals the ops bit for bit.
CHECK_TOLERANCE = 0.75
CHECK_DIFFERING = 1 / 256  # most values of the self-check that may differ from the ops at all


def index_queries_ops(products: mx.array, rope: RoPE, positions) -> mx.array:
    """Reference: `fp4_e8m0_qdq(rope(bf16(products), positions))`, as `Indexer.queries`
    computes them (pure MLX; arguments as in `index_queries`)."""
    return fp4_e8m0_qdq(rope(products.astype(mx.bfloat16), ops_positions(positions)))


def _launch(kernel, products: mx.array, rope: RoPE, positions) -> mx.array:
    cos, sin = angles_of(rope, positions, products.shape[1])
    out, = kernel(inputs=[products, cos, sin], grid=(products.size, 1, 1),
                  threadgroup=(simd_threadgroup(products.size), 1, 1),
                  output_shapes=[products.shape], output_dtypes=[mx.bfloat16])
    return out


def _probe(run, ops) -> None:
    """Products of 3 heads of 64 channels at 2 x 3 rows (a RoPE of 32 channels, rows from
    position 7 on, then the two batch rows from their own first positions 7 and 1000; one head
    all zero): within CHECK_TOLERANCE of the ops, and all but a few values (a fused
    multiply-add's flips) equal to them."""
    rope = RoPE(32, 10000.0)
    x = probe_input()
    for name, positions in (("index_queries", 7), ("index_queries per row", (7, 1000))):
        got, want = run(x, rope, positions), ops(x, rope, positions)
        assert_close(name, got, want, CHECK_TOLERANCE)
        differing = (got != want).sum().item()
        if differing > CHECK_DIFFERING * want.size:
            raise KernelMismatch(f"{name}: {differing} of {want.size} values differ from "
                                 "its ops")


# The kernel as `run(products, rope, positions)`: metal/index_queries.metal, rounding,
# rotation and FP4 fake-quant in one launch.
INDEX_QUERIES = KernelSpec("v41_index_queries", "index_queries", ("products", "cosines", "sines"),
                           ("out",), "index_queries.metal", _launch, _probe, index_queries_ops,
                           headers=("v41_common.h", "attention_prep.h"), exact=False)


def index_queries(products: mx.array, rope: RoPE, positions, use_kernel: Optional[bool] = None,
                  run=None) -> mx.array:
    """FP4-rounded index queries from their projection's products.

    Args:
        products: [B, S, H, D] fp32 products of the indexer's `q_b_proj.matmul` (any float
            dtype), D a multiple of 32.
        rope: the layer's RoPE (rotates the last `rope.rope_dim` channels of each head).
        positions: [S] absolute positions of axis 1, or the int position of its first row
            (both shared by every row of axis 0); or the first position of each row of axis
            0: a tuple or list of B ints, or an integer mx.array [B, 1] (as `rope_products`).
        use_kernel: use the Metal kernel when it applies.
        run: an already built kernel (`INDEX_QUERIES.build(factory)`) to use where it applies,
            e.g. the Metal simulator's in tests.
    Returns:
        [B, S, H, D] bf16, `index_queries_ops(products, rope, positions)` within
        CHECK_TOLERANCE.
    Raises:
        ValueError: per-row positions that do not give one first position per row of axis 0.
    """
    check_row_count("index_queries", positions, products.shape[0] if products.ndim else 0)
    run = INDEX_QUERIES.choose(use_kernel, run)
    if (run is None or not applies(products, rope, positions)
            or products.shape[-1] % FP4_E8M0_BLOCK):
        return index_queries_ops(products, rope, positions)  # also its errors
    return run(products, rope, positions)
