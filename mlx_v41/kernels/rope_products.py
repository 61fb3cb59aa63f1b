"""Attention queries from their projection's fp32 products: the bf16 rounding of `q_b_proj`'s
output, then RoPE on the trailing `qk_rope_head_dim` channels of every head (official
inference/model.py L735–737).

The ops (`rope_products_ops`: a cast, then `RoPE.__call__`'s fused rotation) are two launches
per layer; the Metal kernel (metal/rope_products.metal) rounds and rotates in one, with the
angles of `RoPE.cos_sin` (shared by every layer of a call). It makes the ops' fp32 products and
sums, so it equals them wherever the compiler keeps each product rounded on its own; a fused
multiply-add may move a value by one bf16 rounding: CHECK_TOLERANCE.

Positions (here and in the other RoPE kernels, index_queries.py and norm.py): an int (the first
position of the S rows, shared by every batch row), an [S] array (shared too), or the first
position of each batch row, row b at first[b] .. first[b] + S - 1, as a tuple or list of B ints
(the form `RoPE.__call__` takes) or an integer mx.array [B, 1] (a column: one first position
per row; a 1-D array is always the shared [S] form). The kernels take all of them in one launch:
per-row positions give a [B * S, R / 2] table of angles (`angles_of`), row b * S + s for row s
of batch row b, each angle the bits a batch-1 call at row b's positions computes.
"""

from __future__ import annotations

import weakref
from typing import Optional

import mlx.core as mx
import numpy as np

from ..numerics.rope import RoPE
from .check import assert_close
from .spec import KernelSpec

_FLOAT_DTYPES = (mx.bfloat16, mx.float16, mx.float32)
THREADS = 256  # threads per threadgroup (one per pair)
# Of the largest output: one bf16 rounding (2^-8 of a value) that a fused multiply-add moves,
# with a margin; through the simulator the kernel equals the ops bit for bit.
CHECK_TOLERANCE = 2.0 ** -7
ROW_ANGLES_KEPT = 4  # per-row angle tables kept per RoPE (the layers of one call share them)
_row_angles: "weakref.WeakKeyDictionary[RoPE, dict]" = weakref.WeakKeyDictionary()


def per_row(positions) -> bool:
    """Whether `positions` gives each batch row its first position: a tuple or list of ints, or
    an mx.array [B, 1]."""
    return (isinstance(positions, (tuple, list))
            or (isinstance(positions, mx.array) and positions.ndim == 2))


def ops_positions(positions):
    """`positions` as `RoPE.__call__` takes them: per-row first positions as a tuple of ints
    (an [B, 1] array read back to the host), the shared forms as given."""
    if isinstance(positions, mx.array) and positions.ndim == 2:
        return tuple(int(p) for p in positions.reshape(-1).tolist())
    if isinstance(positions, (tuple, list)):
        return tuple(int(p) for p in positions)
    return positions


def check_row_count(name: str, positions, batch: int) -> None:
    """A one-line ValueError where per-row `positions` do not give one first position per
    batch row (a tuple or list of `batch` ints, or an integer array [batch, 1])."""
    if not per_row(positions):
        return
    if isinstance(positions, mx.array):
        if positions.shape != (batch, 1) or not mx.issubdtype(positions.dtype, mx.integer):
            raise ValueError(f"{name}: per-row positions must be an integer array [{batch}, 1] "
                             f"(one first position per batch row), got {positions.dtype} "
                             f"{tuple(positions.shape)}")
    elif len(positions) != batch:
        raise ValueError(f"{name}: positions holds {len(positions)} first positions for "
                         f"{batch} batch rows")


def positions_fit(positions, batch: int, length: int) -> bool:
    """Whether the RoPE kernels take `positions` for [batch, length] rows: an int, an [S]
    array of `length`, or one first position per batch row (`per_row`)."""
    if isinstance(positions, (tuple, list)):
        return len(positions) == batch
    if isinstance(positions, mx.array):
        if positions.ndim == 2:
            return (positions.shape == (batch, 1)
                    and mx.issubdtype(positions.dtype, mx.integer))
        return positions.shape == (length,)
    return True


def rope_products_ops(products: mx.array, rope: RoPE, positions) -> mx.array:
    """Reference: `rope(bf16(products), positions)`, as the attention computes its queries
    (pure MLX; arguments as in `rope_products`)."""
    return rope(products.astype(mx.bfloat16), ops_positions(positions))


def angles_of(rope: RoPE, positions, length: int):
    """(cos, sin) fp32 angles for the kernels: [S, rope_dim / 2] of shared `positions` (an [S]
    array, or the int first position of `length` contiguous rows: `RoPE.cos_sin`, whose tables
    every layer of the call shares); [B * S, rope_dim / 2] of per-row first positions
    (`per_row`), row b * S + s at position first[b] + s (a tuple's tables kept like
    `RoPE.cos_sin`'s). Each angle is `RoPE.angles` of its position, so its bits do not depend on
    the other rows."""
    if isinstance(positions, mx.array) and positions.ndim == 2:
        rows = positions.astype(mx.int32) + mx.arange(length, dtype=mx.int32)[None, :]
        return rope.angles(rows.reshape(-1))
    if isinstance(positions, (tuple, list)):
        firsts = tuple(int(p) for p in positions)
        kept = _row_angles.setdefault(rope, {})
        key = (firsts, length)
        if key not in kept:
            if len(kept) >= ROW_ANGLES_KEPT:
                kept.pop(next(iter(kept)))
            rows = np.asarray(firsts, np.int64)[:, None] + np.arange(length)
            kept[key] = rope.angles(mx.array(rows.reshape(-1).astype(np.int32)))
        return kept[key]
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
    """Products of 3 heads of 64 channels at 2 x 3 rows (a YaRN RoPE of 32 channels), rows from
    position 65531 on, then the two batch rows from their own first positions (65531 and 3):
    within CHECK_TOLERANCE of the ops."""
    rope = RoPE(32, 160000.0, {"original_max_position_embeddings": 4096, "factor": 16.0,
                                 "beta_fast": 32, "beta_slow": 1})
    x = probe_input()
    assert_close("rope_products", run(x, rope, 65531), ops(x, rope, 65531), CHECK_TOLERANCE)
    firsts = (65531, 3)
    assert_close("rope_products per row", run(x, rope, firsts), ops(x, rope, firsts),
                 CHECK_TOLERANCE)


# The kernel as `run(products, rope, positions)`: metal/rope_products.metal, the bf16 rounding
# and the rotation in one launch.
ROPE_PRODUCTS = KernelSpec("v41_rope_products", "rope_products", ("products", "cosines", "sines"),
                           ("out",), "rope_products.metal", _launch, _probe, rope_products_ops,
                           headers=("v41_common.h", "attention_prep.h"), exact=False)


def applies(products: mx.array, rope: RoPE, positions) -> bool:
    """Shapes the fused kernels take: [B, S, H, D] floats, D and the rotated tail even;
    positions an int, an [S] array, or one first position per batch row (`positions_fit`)."""
    return (products.ndim == 4 and products.size > 0
            and products.dtype in _FLOAT_DTYPES
            and products.shape[-1] % 2 == 0 and rope.rope_dim % 2 == 0
            and 0 < rope.rope_dim <= products.shape[-1]
            and positions_fit(positions, products.shape[0], products.shape[1]))


def rope_products(products: mx.array, rope: RoPE, positions, use_kernel: Optional[bool] = None,
                  run=None) -> mx.array:
    """Queries from their projection's products: RoPE of their bf16 rounding.

    Args:
        products: [B, S, H, D] fp32 products of `q_b_proj.matmul` (any float dtype).
        rope: the layer's RoPE (rotates the last `rope.rope_dim` channels of each head).
        positions: [S] absolute positions of axis 1, or the int position of its first row
            (both shared by every row of axis 0); or the first position of each row of axis
            0: a tuple or list of B ints, or an integer mx.array [B, 1] (module docstring).
        use_kernel: use the Metal kernel when it applies.
        run: an already built kernel (`ROPE_PRODUCTS.build(factory)`) to use where it applies,
            e.g. the Metal simulator's in tests.
    Returns:
        [B, S, H, D] bf16, `rope(products.astype(bf16), positions)` within CHECK_TOLERANCE.
    Raises:
        ValueError: per-row positions that do not give one first position per row of axis 0.
    """
    check_row_count("rope_products", positions, products.shape[0] if products.ndim else 0)
    run = ROPE_PRODUCTS.choose(use_kernel, run)
    if run is None or not applies(products, rope, positions):
        return rope_products_ops(products, rope, positions)
    return run(products, rope, positions)
