"""FP8 activation fake-quant (act_fp8, official inference/model.py `act_quant`): E4M3(x / s) * s
per 32 values along the last axis, s a power of two; with `is_products` the activation is the
bf16 rounding of fp32 projection products.

The ops (`fp8_activation.act_fp8_qdq`, compiled) run 4 kernels per call (|x|, the amax
reduction, the scale, the rounding: element-wise arithmetic that MLX fuses); the Metal kernel
(metal/act_fp8.metal) is one launch, one simdgroup per block, and its values equal the ops' bits.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from ..numerics.fp8_activation import act_fp8_qdq
from ..numerics.quant import ACT_FP8_BLOCK
from .builder import simd_threadgroup
from .check import assert_equal
from .spec import KernelSpec

_FLOAT_DTYPES = (mx.bfloat16, mx.float16, mx.float32)


def act_fp8_ops(x: mx.array, dtype, is_products: bool) -> mx.array:
    """Reference: `fp8_activation.act_fp8_qdq` (pure MLX, compiled); arguments as in `act_fp8`."""
    return act_fp8_qdq(x, dtype, is_products)


def _launch(kernel, x: mx.array, dtype, is_products: bool) -> mx.array:
    dtype = dtype or x.dtype
    out, = kernel(inputs=[x.reshape(-1)], template=[("T", dtype), ("P", bool(is_products))],
                  grid=(x.size, 1, 1), threadgroup=(simd_threadgroup(x.size), 1, 1),
                  output_shapes=[(x.size,)], output_dtypes=[dtype])
    return out.reshape(x.shape)


def _probe(run, ops) -> None:
    """Four blocks of fp32 products and of bf16 values (one all zero): bits equal to the ops'."""
    x = mx.sin(mx.arange(4 * 64, dtype=mx.float32) * 0.37).reshape(4, 64) * 300
    x = mx.concatenate([x[:, :32] * 0, x[:, 32:]], axis=-1)
    assert_equal("act_fp8 products", run(x, mx.float32, True), ops(x, mx.float32, True))
    x = x.astype(mx.bfloat16)
    assert_equal("act_fp8", run(x, mx.bfloat16, False), ops(x, mx.bfloat16, False))


# The kernel as `run(x, dtype, is_products)`: metal/act_fp8.metal, one simdgroup per block.
ACT_FP8 = KernelSpec("v41_act_fp8", "act_fp8", ("x",), ("out",), "act_fp8.metal", _launch,
                     _probe, act_fp8_ops, headers=("v41_common.h",))


def act_fp8(x: mx.array, dtype=None, is_products: bool = False, use_kernel: Optional[bool] = None,
            run=None) -> mx.array:
    """act_fp8 quantise-dequantise of an activation.

    Args:
        x: [..., K] bf16/f16/f32, K a multiple of 32 (with `is_products`: fp32 products whose
            bf16 rounding is the activation).
        dtype: output dtype (default x.dtype; the values are exact in bf16 and fp32).
        is_products: see x.
        use_kernel: use the Metal kernel when it applies.
        run: an already built kernel (`ACT_FP8.build(factory)`) to use unconditionally, e.g. the
            Metal simulator's in tests.
    Returns:
        [..., K] in dtype, identical to `fp8_activation.act_fp8_qdq(x, dtype, is_products)`.
    """
    run = ACT_FP8.choose(use_kernel, run)
    if (run is None or x.ndim == 0 or x.size == 0 or x.shape[-1] % ACT_FP8_BLOCK
            or x.dtype not in _FLOAT_DTYPES):
        return act_fp8_qdq(x, dtype, is_products)  # also its error for a bad width
    return run(x, dtype, is_products)
