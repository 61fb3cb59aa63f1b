"""FP8 activation fake-quant (the reference's `act_quant`, block 32, power-of-two scale,
E4M3 values), run before every FP8 linear: written as element-wise arithmetic that
`mx.compile` fuses (4 kernels instead of 8 on MLX's CPU backend), checked once per device
against the `to_fp8` / `from_fp8` form, which it falls back to where it differs."""

from __future__ import annotations

import functools

import mlx.core as mx

from .quant import (ACT_FP8_AMAX_FLOOR, ACT_FP8_BLOCK, FP8_E4M3_MAX, _check_groups, _compiled,
                    _exponent_byte, _groups, _pow2_ceil)

# Veltkamp splitting, written so that `mx.compile` fuses it (every shared array is read
# first along one chain of first operands): with n = -(2^s + 1) v, (n + v) - n is v rounded
# to 24 - s significant bits, ties to even (checked on every fp32 mantissa; the values that
# act_fp8 meets: tests/test_act_fp8_arith.py).
_SPLIT_TO_1_BIT = -float(2**23 + 1)
_SPLIT_TO_4_BITS = -float(2**20 + 1)  # E4M3 normals: 1 + 3 mantissa bits
_E4M3_STEP = 2.0**-9  # the E4M3 subnormal spacing; normals start at 8 steps (2^-6)
_SHIFT = 2.0**64  # keeps (2^23 + 1) t finite for every t an fp32 amax gives
_RECIP_448 = float(mx.array(1.0 / FP8_E4M3_MAX, mx.float32).item())  # the reference's 1/448


def _split(v: mx.array, factor: float) -> mx.array:
    n = v * factor
    return (n + v) - n


def _act_fp8_step(amax: mx.array) -> mx.array:
    """The act_fp8 scale s = `_pow2_ceil`(max(amax, 1e-4) * fp32(1/448)) times 2^-9, in
    arithmetic: t rounded to one significant bit is 2^e or 2^(e+1), doubled when below t
    (t is scaled by 2^-64 first, exactly: t >= 2^-22)."""
    # fp32(1/448) 2^-64 is exact, so this is the fp32 product of amax and 1/448, times 2^-64.
    t = mx.maximum(amax, ACT_FP8_AMAX_FLOOR) * (_RECIP_448 / _SHIFT)
    one_bit = _split(t, _SPLIT_TO_1_BIT)
    return mx.where(one_bit < t, 2.0 * _SHIFT * _E4M3_STEP, _SHIFT * _E4M3_STEP) * one_bit


def _round_e4m3_steps(w: mx.array) -> mx.array:
    """E4M3 rounding of y = w / 512 (|y| <= 448 (1 + 2^-22): s may round below amax / 448 by
    that much, and the reference's clip to 448 then changes nothing), in units of 2^-9: 4
    significant bits from 8 units up, whole units below (`mx.round`: half to even, and
    zeros keep the sign, as E4M3 codes do). Whether w is below 8 is read off its 4-bit
    rounding (the same answer, and it keeps the kernel fused)."""
    normal = _split(w, _SPLIT_TO_4_BITS)
    return mx.round(mx.where(mx.abs(normal) < 8.0, w, normal))


def _act_fp8_step_bits(amax: mx.array) -> mx.array:
    """`_act_fp8_step` through the fp32 bit pattern (a bit view: not fused)."""
    t = mx.maximum(amax, ACT_FP8_AMAX_FLOOR) * mx.array(1.0 / FP8_E4M3_MAX, dtype=mx.float32)
    return _pow2_ceil(t) * _E4M3_STEP


def _act_fp8_parts(x: mx.array, is_products: bool = False, arithmetic: bool = True):
    """act_fp8 on groups [..., G, 32]: the fp32 activation g and its step s 2^-9 (s = 2^e
    the scale; g / step is 512 g / s, exact). With `is_products` the activation is bf16(x)
    of fp32 products x; `arithmetic=False` takes the step from the bit pattern."""
    groups = _groups(x, ACT_FP8_BLOCK)
    # |x| before the cast (the same values): the cast then fuses into both of its readers
    # instead of being one more kernel whose output both read. (bf16 rounding is symmetric,
    # so |bf16(x)| = bf16(|x|): the products' rounding splits the same way.)
    amax = _as_bf16(mx.abs(groups), is_products).astype(mx.float32).max(axis=-1, keepdims=True)
    step = (_act_fp8_step if arithmetic else _act_fp8_step_bits)(amax)
    return _as_bf16(groups, is_products).astype(mx.float32), step


def _as_bf16(x: mx.array, is_products: bool) -> mx.array:
    return x.astype(mx.bfloat16) if is_products else x


def act_fp8_quantize(x: mx.array):
    """FP8 activation quantisation, block 32, E8M0 scale (the reference's `act_quant`).

    Args:
        x: [..., K] float, K a multiple of 32.
    Returns:
        (codes uint8 [..., K] E4M3FN, scale_bytes uint8 [..., K/32] E8M0).
    """
    g, step = _act_fp8_parts(x, arithmetic=is_arithmetic_exact(str(mx.default_device())))
    codes = mx.to_fp8(g / step * _E4M3_STEP)  # g / s (where g / s is subnormal: 0 either way)
    return codes.reshape(x.shape), _exponent_byte(step, shift=9)


def act_fp8_qdq(x: mx.array, dtype=None, is_products: bool = False) -> mx.array:
    """act_fp8 quantise-dequantise: E4M3(x / s) * s with s a power of two; returns `dtype`
    (default x.dtype; the values are exact in bf16 and fp32 alike). Compiled: it runs before
    every FP8 linear, and on MLX's CPU backend the op count is what a decode step costs.
    `is_products`: x is fp32 products and the activation their bf16 rounding."""
    return _compiled_act_fp8(dtype or x.dtype, is_products, str(mx.default_device()))(x)


def _act_fp8_qdq(x: mx.array, dtype, is_products: bool) -> mx.array:
    """`_act_fp8_parts`, then E4M3 rounding and x s, in element-wise arithmetic only (no bit
    views, no `to_fp8` / `from_fp8`): `mx.compile` makes it 4 kernels (|x|, the amax, the
    scale, the rest) instead of 8, with the same bits (tests/test_act_fp8_arith.py)."""
    g, step = _act_fp8_parts(x, is_products)
    values = _round_e4m3_steps(g / step) * step
    # The cast (or, to fp32, an exact x 1 in its place) keeps `step` out of the last kernel's
    # reach through g / step: `mx.compile` fuses at most 11 levels deep, and pulling `step` in
    # there would cut the scale's chain into pieces (3 kernels more).
    values = values * 1.0 if values.dtype == dtype else values.astype(dtype)
    return values.reshape(x.shape)


def _act_fp8_qdq_fp8(x: mx.array, dtype, is_products: bool) -> mx.array:
    """The same through `to_fp8` / `from_fp8` and a bit-view scale (8 kernels): the reference
    of `_act_fp8_qdq`, used where that one does not give its bits (`checked_act_fp8`)."""
    g, step = _act_fp8_parts(x, is_products, arithmetic=False)
    values = mx.from_fp8(mx.to_fp8(g / step * _E4M3_STEP), mx.float32) * step * 512.0
    return values.reshape(x.shape).astype(dtype)


@functools.cache
def _compiled_act_fp8(dtype, is_products: bool, device: str):
    """The arithmetic form where it is exact on this device (`is_arithmetic_exact`)."""
    form = _act_fp8_qdq if is_arithmetic_exact(device) else _act_fp8_qdq_fp8
    return mx.compile(functools.partial(form, dtype=dtype, is_products=is_products))


@functools.cache
def is_arithmetic_exact(device: str) -> bool:
    """Whether the arithmetic act_fp8 gives the `to_fp8` form's bits on `device` (the
    default device when called), checked once."""
    compiled = [mx.compile(functools.partial(f, dtype=mx.float32, is_products=False))
                for f in (_act_fp8_qdq, _act_fp8_qdq_fp8)]
    return checked_act_fp8(*compiled, f"act_fp8 on {device}") is compiled[0]


def checked_act_fp8(arithmetic, reference, name: str):
    """`arithmetic` if it gives `reference`'s bits on every finite bf16 value and on fp32
    values at the scale's edges (its Veltkamp splits need each product rounded on its own:
    a compiler that fuses a multiply into an add, as some do by default on FMA hardware,
    changes them); otherwise `reference`, with one warning."""
    probe = _act_fp8_probe()
    same = [mx.array_equal(a(x).view(mx.uint32), b(x).view(mx.uint32))
            for a, b in ((arithmetic, reference),) for x in probe]
    if all(bool(v) for v in same):
        return arithmetic
    import warnings
    warnings.warn(f"{name}: the element-wise E4M3 rounding differs from to_fp8 on this device "
                  "(fused multiply-adds?); using to_fp8 / from_fp8", RuntimeWarning, stacklevel=3)
    return reference


@functools.cache
def _act_fp8_probe() -> tuple:
    """Every finite bf16 value (groups of 32), and fp32 groups whose amax sits at and around
    448 x 2^k (where the scale changes) with values at E4M3 midpoints of their scale."""
    every = mx.arange(1 << 16, dtype=mx.uint32).astype(mx.uint16).view(mx.bfloat16)
    every = every.astype(mx.float32)
    every = mx.where(mx.isfinite(every), every, 0.0)
    k = mx.arange(-20, 21, dtype=mx.float32)
    edges = mx.concatenate([448.0 * mx.power(2.0, k) * f for f in
                            (1.0, 1.0 - 2.0**-24, 1.0 + 2.0**-23, 0.75, 1.5)])
    mids = mx.arange(1, 32, dtype=mx.float32) * (1.0 + 2.0**-4)  # odd steps off the grid
    groups = edges[:, None] * mx.concatenate([mx.ones((1,)), mids / 32.0])[None, :]
    return every.reshape(-1, 32), groups


def pack_fp8_e8m0(x: mx.array) -> mx.array:
    """Encode with act_fp8 into packed rows: [..., K] -> uint8 [..., K + K/32]."""
    _check_groups(x, ACT_FP8_BLOCK)
    return _compiled(_pack_fp8_e8m0)(x)


def _pack_fp8_e8m0(x: mx.array) -> mx.array:
    codes, scale_bytes = act_fp8_quantize(x)
    return mx.concatenate([codes, scale_bytes], axis=-1)
