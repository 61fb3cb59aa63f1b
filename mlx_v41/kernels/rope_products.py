"""Attention queries from their projection's fp32 products: the bf16 rounding of `q_b_proj`'s
output, then RoPE on the trailing `qk_rope_head_dim` channels of every head (official
inference/model.py L735–737).

The ops (`rope_products_ops`: a cast, then `RoPE.__call__`'s fused rotation) are two launches
per layer; the Metal kernel (metal/rope_products.metal) rounds and rotates in one, with the
angles of `RoPE.cos_sin` (shared by every layer of a call). It makes the ops' fp32 products and
sums, so it equals them wherever the compiler keeps each product rounded on its own; a fused
multiply-add may move a value by one bf16 rounding: CHECK_TOLERANCE.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from ..numerics.rope import RoPE
from .check import assert_close
from .spec import KernelSpec

_FLOAT_DTYPES = (mx.bfloat16, mx.float16, mx.float32)
THREADS = 256  # threads per threadgroup (one per pair)
# Of the largest output: one bf16 rounding (2^-8 of a value) that a fused multiply-add moves,
# with a margin; through the simulator the kernel equals the ops bit for bit.
CHECK_TOLERANCE = 2.0 ** -7


def rope_products_ops(products: mx.array, rope: RoPE, positions) -> mx.array:
    """Reference: `rope(bf16(products), positions)`, as the attention computes its queries
    (pure MLX; arguments as in `rope_products`)."""
    return rope(products.astype(mx.bfloat16), positions)


def angles_of(rope: RoPE, positions, length: int):
    """(cos, sin) [S, rope_dim / 2] fp32 of `positions` (an array, or the int first position of
    `length` contiguous rows, whose angles every layer of the call shares)."""
    key = positions if isinstance(positions, mx.array) else (int(positions), length)
    return rope.cos_sin(key)


def _launch(kernel, products: mx.array, rope: RoPE, positions) -> mx.array:
    cos, sin = angles_of(rope, positions, products.shape[1])
    pairs = products.size // 2
    out, = kernel(inputs=[products, cos, sin], grid=(pairs, 1, 1),
                  threadgroup=(min(THREADS, pairs), 1, 1),
                  output_shapes=[products.shape], output_dtypes=[mx.bfloat16])
    return out


def probe_input(heads: int = 3, dim: int = 64) -> mx.array:
    """Deterministic fp32 products [2, 3, heads, dim] spanning 2^-20 .. 2^12, one head zero."""
    count = 2 * 3 * heads * dim
    x = mx.sin(mx.arange(count, dtype=mx.float32) * 0.61) * 4096
    x = x * mx.power(2.0, -(mx.arange(count) % 33).astype(mx.float32))
    x = x.reshape(2, 3, heads, dim)
    return mx.concatenate([x[:, :, :1] * 0, x[:, :, 1:]], axis=2)


def _probe(run, ops) -> None:
    """Products of 3 heads of 64 channels at 2 x 3 rows (a YaRN RoPE of 32 channels, rows from
    position 65531 on): within CHECK_TOLERANCE of the ops."""
    rope = RoPE(32, 160000.0, {"original_max_position_embeddings": 4096, "factor": 16.0,
                                 "beta_fast": 32, "beta_slow": 1})
    x = probe_input()
    assert_close("rope_products", run(x, rope, 65531), ops(x, rope, 65531), CHECK_TOLERANCE)


# The kernel as `run(products, rope, positions)`: metal/rope_products.metal, the bf16 rounding
# and the rotation in one launch.
ROPE_PRODUCTS = KernelSpec("v41_rope_products", "rope_products", ("products", "cosines", "sines"),
                           ("out",), "rope_products.metal", _launch, _probe, rope_products_ops,
                           headers=("v41_common.h", "attention_prep.h"), exact=False)


def applies(products: mx.array, rope: RoPE, positions) -> bool:
    """Shapes the fused kernels take: [B, S, H, D] floats, D and the rotated tail even, array
    positions one per row (not a tuple of first positions per batch row: the ops take those)."""
    return (not isinstance(positions, tuple) and products.ndim == 4 and products.size > 0
            and products.dtype in _FLOAT_DTYPES
            and products.shape[-1] % 2 == 0 and rope.rope_dim % 2 == 0
            and 0 < rope.rope_dim <= products.shape[-1]
            and (not isinstance(positions, mx.array) or positions.shape == products.shape[1:2]))


def rope_products(products: mx.array, rope: RoPE, positions, use_kernel: Optional[bool] = None,
                  run=None) -> mx.array:
    """Queries from their projection's products: RoPE of their bf16 rounding.

    Args:
        products: [B, S, H, D] fp32 products of `q_b_proj.matmul` (any float dtype).
        rope: the layer's RoPE (rotates the last `rope.rope_dim` channels of each head).
        positions: [S] absolute positions of axis 1, or the int position of its first row, or
            a tuple of the first position of each row of axis 0 (the ops).
        use_kernel: use the Metal kernel when it applies.
        run: an already built kernel (`ROPE_PRODUCTS.build(factory)`) to use where it applies,
            e.g. the Metal simulator's in tests.
    Returns:
        [B, S, H, D] bf16, `rope(products.astype(bf16), positions)` within CHECK_TOLERANCE.
    """
    run = ROPE_PRODUCTS.choose(use_kernel, run)
    if run is None or not applies(products, rope, positions):
        return rope_products_ops(products, rope, positions)
    return run(products, rope, positions)
