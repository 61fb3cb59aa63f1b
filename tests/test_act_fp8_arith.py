"""act_fp8_qdq's element-wise arithmetic (Veltkamp splits, `mx.round`) against the form it
replaced: `_act_fp8_parts`, MLX's `to_fp8` / `from_fp8` and the bit-view power-of-two ceil,
bit for bit on the CPU backend: the E4M3 rounding on every bf16 value and every E4M3 midpoint
with its fp32 neighbours, the scale on every positive bf16 amax, the whole function on every
bf16 input and on fp32 groups whose amax sits at 448 2^k."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_v41.numerics import fp8_activation as fp8
from mlx_v41.numerics import quant

pytestmark = pytest.mark.usefixtures("cpu")

E4M3_MAX = 448.0


def bits(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)).view(np.uint32)


def e4m3_reference(y: mx.array) -> mx.array:
    return mx.from_fp8(mx.to_fp8(mx.clip(y, -E4M3_MAX, E4M3_MAX)), mx.float32)


def scale_reference(amax: mx.array) -> mx.array:
    """The replaced scale: the power-of-two ceil from the fp32 bit pattern."""
    t = mx.maximum(amax, quant.ACT_FP8_AMAX_FLOOR) * mx.array(1.0 / E4M3_MAX, mx.float32)
    return quant._pow2_ceil(t)


def qdq_reference(x: mx.array, dtype, is_products: bool) -> mx.array:
    """The replaced form: x / s through to_fp8 / from_fp8, times s."""
    groups = x.reshape(*x.shape[:-1], -1, 32)
    if is_products:
        groups = groups.astype(mx.bfloat16)
    g = groups.astype(mx.float32)
    scale = scale_reference(mx.abs(g).max(axis=-1, keepdims=True))
    return (mx.from_fp8(mx.to_fp8(g / scale), mx.float32) * scale).reshape(x.shape).astype(dtype)


def finite_bf16() -> np.ndarray:
    values = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    values = values[(values & 0x7F80) != 0x7F80]  # no inf / nan
    return (values.astype(np.uint32) << 16).view(np.float32)


def neighbours(values: np.ndarray, steps: int = 2) -> np.ndarray:
    """Each fp32 value with its `steps` fp32 neighbours either side."""
    v = np.asarray(values, np.float32).view(np.int32).astype(np.int64)
    around = (v[:, None] + np.arange(-steps, steps + 1)[None, :]).ravel()
    return around[(around >= 0) & (around < 0x7F800000)].astype(np.int32).view(np.float32)


def e4m3_probe_values() -> np.ndarray:
    codes = np.arange(0x7F, dtype=np.uint8)  # every finite non-negative code
    grid = np.array(mx.from_fp8(mx.array(codes), mx.float32))
    midpoints = (grid[:-1].astype(np.float64) + grid[1:]) / 2  # exact in fp32
    edges = [0.0, 2.0**-10, 2.0**-6, 448.0, 448.0 * (1 + 2.0**-22), 460.0, 1e-40, 1e-45]
    y = np.concatenate([neighbours(grid), neighbours(midpoints.astype(np.float32)),
                        neighbours(np.array(edges, np.float32)),
                        finite_bf16()[np.abs(finite_bf16()) <= 448.0 * (1 + 2.0**-22)]])
    rng = np.random.default_rng(7)
    exponents = rng.uniform(-30, 8.8, 200_000)
    y = np.concatenate([y, np.exp2(exponents).astype(np.float32)])
    return np.concatenate([y, -y]).astype(np.float32)


def test_e4m3_rounding_every_midpoint_bf16_value_and_subnormal():
    y = e4m3_probe_values()
    assert np.abs(y).max() < 464  # the documented range: |x / s| <= 448 (1 + 2^-22)
    got = mx.compile(lambda w: fp8._round_e4m3_steps(w) * fp8._E4M3_STEP)(
        mx.array(y) * 2.0**9)
    np.testing.assert_array_equal(bits(got), bits(e4m3_reference(mx.array(y))))
    # -0 and negatives that round to zero keep the sign, as the E4M3 codes do
    assert bits(got)[np.nonzero(y == -1e-40)[0][0]] == 0x80000000


def test_scale_every_positive_bf16_amax_and_powers_of_two():
    amax = finite_bf16()
    amax = amax[amax >= 0]
    sevens = 448.0 * np.exp2(np.arange(-30, 100, dtype=np.float64)).astype(np.float32)
    rng = np.random.default_rng(11)
    amax = np.concatenate([amax, neighbours(sevens, 4), np.float32([3.4e38]),
                           np.exp2(rng.uniform(-40, 127, 100_000)).astype(np.float32)])
    a = mx.array(amax.astype(np.float32))[:, None]
    want = scale_reference(a) * fp8._E4M3_STEP
    got = mx.compile(fp8._act_fp8_step)(a)
    np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_qdq_every_bf16_input(dtype):
    x = finite_bf16()
    x = np.concatenate([x, np.zeros(-len(x) % 32, np.float32)])
    rng = np.random.default_rng(3)
    for order in (np.arange(len(x)), rng.permutation(len(x))):  # sorted and mixed groups
        xb = mx.array(x[order]).reshape(-1, 64).astype(mx.bfloat16)
        np.testing.assert_array_equal(bits(fp8.act_fp8_qdq(xb, dtype)),
                                      bits(qdq_reference(xb, dtype, False)))


@pytest.mark.parametrize("is_products", [False, True])
def test_qdq_fp32_groups_at_the_scale_boundaries(is_products):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4096, 32)).astype(np.float32)
    x *= np.exp2(rng.integers(-30, 30, (4096, 1))).astype(np.float32)
    # amax at 448 2^k and its fp32 neighbours: the scale's rounding edge
    peaks = neighbours(448.0 * np.exp2(np.arange(-20, 20, dtype=np.float64)), 3)
    x[: len(peaks), 0] = peaks * np.where(np.arange(len(peaks)) % 2, -1, 1)
    x[-8:] = 0.0
    x[-4:, 3] = -1e-30  # rounds to -0
    xm = mx.array(x).reshape(64, 2048)
    for dtype in (mx.bfloat16, mx.float32):
        np.testing.assert_array_equal(bits(fp8.act_fp8_qdq(xm, dtype, is_products)),
                                      bits(qdq_reference(xm, dtype, is_products)))


def test_quantize_codes_and_scale_bytes_every_bf16_input_and_boundaries():
    """act_fp8_quantize (the window ring's packing) divides by the arithmetic step: the same
    codes and E8M0 bytes as x / s through to_fp8 and the scale's exponent field."""
    x = finite_bf16()
    x = np.concatenate([x, np.zeros(-len(x) % 32, np.float32)])
    peaks = neighbours(448.0 * np.exp2(np.arange(-20, 20, dtype=np.float64)), 3)
    rows = [mx.array(x).reshape(-1, 64).astype(mx.bfloat16),
            mx.array(np.repeat(peaks[:, None], 32, axis=1) * np.float32(0.7) ** np.arange(32))]
    for xm in rows:
        codes, scale_bytes = fp8.act_fp8_quantize(xm)
        g = xm.reshape(*xm.shape[:-1], -1, 32).astype(mx.float32)
        scale = scale_reference(mx.abs(g).max(axis=-1, keepdims=True))
        np.testing.assert_array_equal(np.array(codes),
                                      np.array(mx.to_fp8(g / scale).reshape(xm.shape)))
        want_bytes = np.log2(np.array(scale[..., 0]).astype(np.float64)) + 127
        np.testing.assert_array_equal(np.array(scale_bytes), want_bytes.astype(np.uint8))


def test_the_arithmetic_form_is_checked_once_per_device_with_a_fallback():
    """`checked_act_fp8` keeps the arithmetic form where it gives the to_fp8 form's bits
    (here), and falls back, with one warning, to the to_fp8 form where it does not (a
    stand-in for a compiler that fuses the splits' multiply-adds: a split one bit short);
    the fallback is the replaced form bit for bit."""
    import functools
    import warnings

    def form(f):
        return mx.compile(functools.partial(f, dtype=mx.float32, is_products=False))

    arithmetic, reference = form(fp8._act_fp8_qdq), form(fp8._act_fp8_qdq_fp8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fp8.checked_act_fp8(arithmetic, reference, "act_fp8") is arithmetic

    def fused(x, dtype, is_products):
        g, step = fp8._act_fp8_parts(x, is_products)
        w = g / step
        n = w * -float(2**21 + 1)  # 3 significant bits: what a changed rounding looks like
        return (mx.round(mx.where(mx.abs(w) < 8.0, w, (n + w) - n)) * step).astype(dtype)

    with pytest.warns(RuntimeWarning, match=r"^act_fp8: the element-wise E4M3 rounding "
                                            r"differs from to_fp8 on this device"):
        assert fp8.checked_act_fp8(form(fused), reference, "act_fp8") is reference
    x = mx.array(finite_bf16()).reshape(-1, 64)
    for is_products in (False, True):
        np.testing.assert_array_equal(
            bits(fp8._act_fp8_qdq_fp8(x, mx.float32, is_products)),
            bits(qdq_reference(x, mx.float32, is_products)))
