"""Clamped SwiGLU of the experts' gate / up products, then act_fp8 of the result (the down
projection's FP8 input; official inference/model.py L792-840): `silu(min(g, limit)) *
clip(u, -limit, limit)`, times the routed weight for the routed experts, rounded to bf16.

The ops are the model's own: one compiled SwiGLU kernel from the two matmuls' fp32 products
(each rounded to bf16 first, as the projections' outputs are), then the act_fp8 kernel. The
Metal kernel (metal/swiglu_act_fp8.metal) does both in one launch. It computes MLX's Metal
sigmoid formula; every other step is exact, so its values differ from the ops' only where
exp's last bit moves a bf16 rounding (and, rarely, an E4M3 rounding or a block's scale after
it): within one E4M3 step of the block's scale of the ops' value, at a few values in 10^4
against MLX's CPU exp (the simulator), and expected bit-identical on Apple's GPU where the
custom kernel's exp is MLX's (not verified here: no Metal device).
"""

from __future__ import annotations

import functools
from typing import Optional

import mlx.core as mx

from ..numerics.fp8_activation import act_fp8_qdq
from ..numerics.quant import ACT_FP8_BLOCK
from .act_fp8 import act_fp8
from .builder import simd_threadgroup
from .check import assert_close
from .spec import KernelSpec

# Of the largest output: one E4M3 step at the top of a block is 32/448 of its maximum, and a
# last-bit difference of exp can move one value by that step (or a block's scale by 2x).
CHECK_TOLERANCE = 2.0 ** -3


def swiglu(gate: mx.array, up: mx.array, limit: float) -> mx.array:
    """fp32 `silu(min(g, limit)) * clip(u, -limit, limit)`."""
    gate = mx.minimum(gate.astype(mx.float32), limit)
    up = mx.clip(up.astype(mx.float32), -limit, limit)
    return gate * mx.sigmoid(gate) * up


def swiglu_of_products(gate: mx.array, up: mx.array, weights, limit: float) -> mx.array:
    """bf16 of the (weighted) SwiGLU of fp32 projection products, each rounded to bf16 first
    as the projections' outputs are: one fused kernel from the two matmuls to the next."""
    act = swiglu(gate.astype(mx.bfloat16), up.astype(mx.bfloat16), limit)
    return (act if weights is None else act * weights).astype(mx.bfloat16)


@functools.cache
def compiled_swiglu_of_products(limit: float, weighted: bool):
    """`swiglu_of_products` compiled per limit, as `f(gate, up, weights)` or `f(gate, up)`."""
    if weighted:
        return mx.compile(functools.partial(swiglu_of_products, limit=limit))
    return mx.compile(lambda gate, up: swiglu_of_products(gate, up, None, limit))


def swiglu_act_fp8_ops(gate: mx.array, up: mx.array, weights, limit: float) -> mx.array:
    """Reference: the model's compiled SwiGLU of the products, then act_fp8 to fp32."""
    swiglu_fn = compiled_swiglu_of_products(limit, weights is not None)
    act = swiglu_fn(gate, up) if weights is None else swiglu_fn(gate, up, weights)
    return act_fp8_qdq(act, mx.float32)


def _launch(kernel, gate: mx.array, up: mx.array, weights, limit: float) -> mx.array:
    if gate.shape != up.shape:
        raise ValueError(f"swiglu_act_fp8: gate {gate.shape} and up {up.shape} differ")
    width, size = gate.shape[-1], gate.size
    if weights is not None and weights.size * width != size:
        raise ValueError(f"swiglu_act_fp8: {weights.size} weights for {size // width} rows")
    # Unweighted: `weight` is bound to gate (never read; W is false).
    weight = gate if weights is None else weights.reshape(-1)
    out, = kernel(inputs=[gate.reshape(-1), up.reshape(-1), weight, float(limit)],
                  template=[("I", width), ("W", weights is not None)],
                  grid=(size, 1, 1), threadgroup=(simd_threadgroup(size), 1, 1),
                  output_shapes=[(size,)], output_dtypes=[mx.float32])
    return out.reshape(gate.shape)


def _probe(run, ops) -> None:
    """Three rows of 64 products past the limit on both sides, weighted and not."""
    wave = lambda n, f: mx.sin(mx.arange(n, dtype=mx.float32) * f)  # noqa: E731
    gate, up = (wave(3 * 64, 0.37) * 14).reshape(3, 64), (wave(3 * 64, 0.23) * 12).reshape(3, 64)
    weights = mx.array([[0.7], [0.05], [1.3]])
    assert_close("swiglu_act_fp8", run(gate, up, None, 10.0), ops(gate, up, None, 10.0),
                 CHECK_TOLERANCE)
    assert_close("swiglu_act_fp8 weighted", run(gate, up, weights, 10.0),
                 ops(gate, up, weights, 10.0), CHECK_TOLERANCE)


# The kernel as `run(gate, up, weights, limit)`: metal/swiglu_act_fp8.metal, the SwiGLU and
# its act_fp8 in one launch.
SWIGLU_ACT_FP8 = KernelSpec("v41_swiglu_act_fp8", "swiglu_act_fp8",
                            ("gate", "up", "weight", "limit"), ("out",), "swiglu_act_fp8.metal",
                            _launch, _probe, swiglu_act_fp8_ops, headers=("v41_common.h",),
                            exact=False)


def swiglu_act_fp8(gate: mx.array, up: mx.array, weights, limit: float,
                   use_kernel: Optional[bool] = None, run=None) -> mx.array:
    """act_fp8 of the bf16 clamped SwiGLU of projection products: the down projection's input.

    Args:
        gate, up: [..., I] fp32 products of the gate and up projections, I a multiple of 32.
        weights: None, or one routed weight per row of I values ([..., 1], fp32).
        limit: the SwiGLU clamp (`swiglu_limit`).
        use_kernel: use the Metal kernel when it applies.
        run: an already built kernel (`SWIGLU_ACT_FP8.build(factory)`) to use unconditionally,
            e.g. the Metal simulator's in tests.
    Returns:
        [..., I] fp32: `swiglu_act_fp8_ops(gate, up, weights, limit)`, to the kernel's stated
        tolerance (see the module docstring).
    """
    given = use_kernel
    run = SWIGLU_ACT_FP8.choose(use_kernel, run)
    if gate.size == 0 or gate.shape[-1] % ACT_FP8_BLOCK or gate.dtype != mx.float32:
        return swiglu_act_fp8_ops(gate, up, weights, limit)  # also its error for a bad width
    if run is None:
        # the two steps: the compiled SwiGLU, then act_fp8 through its own dispatcher (the
        # same bits as the ops; its kernel where one is active)
        swiglu_fn = compiled_swiglu_of_products(limit, weights is not None)
        act = swiglu_fn(gate, up) if weights is None else swiglu_fn(gate, up, weights)
        return act_fp8(act, mx.float32, use_kernel=given)
    return run(gate, up, weights, limit)
