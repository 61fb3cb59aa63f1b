"""quant.py against an independent numpy model of the FP8 / FP4 formats and their rounding.

The numpy side decodes formats from their bit fields and rounds by nearest-grid search with an
explicit even-code tie rule, so it shares no code or tricks with the MLX implementation. The
MLX side runs on the CPU backend (the `cpu` fixture): the bit-exact results are claimed there;
on a Mac the Metal packing kernel is compared with these ops on the device in test_kernels.py.
"""

import math

import mlx.core as mx
import numpy as np
import pytest

from mlx_v41.numerics import fp8_activation as fp8
from mlx_v41.numerics import quant

pytestmark = pytest.mark.usefixtures("cpu")

RNG_SEED = 20240601
E4M3_NAN = (0x7F, 0xFF)
E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


# ---------------------------------------------------------------- numpy reference

def ref_e4m3_decode(code: int) -> float:
    sign = -1.0 if code & 0x80 else 1.0
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    if exponent == 15 and mantissa == 7:
        return math.nan
    if exponent == 0:
        return sign * mantissa / 8 * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


E4M3_TABLE = np.array([ref_e4m3_decode(c) for c in range(256)])
E4M3_GRID = E4M3_TABLE[:0x7F]  # non-negative finite values, ascending, index == code


def ref_nearest(a: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Index of the nearest grid value to each a >= 0 (grid ascending, index = code);
    exact float64 distances, ties to the even index."""
    hi = np.clip(np.searchsorted(grid, a), 1, len(grid) - 1)
    lo = hi - 1
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return np.where(pick_hi, hi, lo)


def ref_float_to_e4m3(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    a = np.minimum(np.abs(x).astype(np.float64), 448.0)
    return (ref_nearest(a, E4M3_GRID) | (np.signbit(x) << 7)).astype(np.uint8)


def ref_float_to_e2m1(v) -> np.ndarray:
    v = np.asarray(v, dtype=np.float32)
    return (ref_nearest(np.abs(v).astype(np.float64), E2M1_MAGNITUDES)
            | (np.signbit(v) << 3)).astype(np.uint8)


def ref_e2m1_decode(codes) -> np.ndarray:
    codes = np.asarray(codes)
    mag = E2M1_MAGNITUDES[codes & 7]
    return np.where(codes & 8, -mag, mag).astype(np.float32)


def ref_ceil_log2(t: np.ndarray) -> np.ndarray:
    """Smallest integer e with 2^e >= t, via frexp (t = m * 2^ex, m in [0.5, 1))."""
    m, ex = np.frexp(t.astype(np.float64))
    return np.where(m == 0.5, ex - 1, ex)


def ref_groups(x: np.ndarray, size: int) -> np.ndarray:
    return x.astype(np.float32).reshape(*x.shape[:-1], x.shape[-1] // size, size)


def ref_act_fp8(x: np.ndarray):
    """numerics.md §3.1 -> (codes, scale bytes, dequantised fp32)."""
    g = ref_groups(x, 32)
    amax = np.maximum(np.abs(g).max(-1, keepdims=True), np.float32(1e-4))
    e = ref_ceil_log2(amax * np.float32(1 / 448))
    s = np.ldexp(np.float32(1), e).astype(np.float32)
    codes = ref_float_to_e4m3(np.clip(g / s, -448, 448))
    deq = (E4M3_TABLE[codes] * s).astype(np.float32)
    return codes.reshape(x.shape), (e[..., 0] + 127).astype(np.uint8), deq.reshape(x.shape)


def ref_fp4_e8m0(x: np.ndarray):
    g = ref_groups(x, 32)
    amax = np.maximum(np.abs(g).max(-1, keepdims=True), np.float32(6 * 2.0**-126))
    e = ref_ceil_log2(amax * np.float32(1 / 6))
    s = np.ldexp(np.float32(1), e).astype(np.float32)
    codes = ref_float_to_e2m1(np.clip(g / s, -6, 6))
    deq = (ref_e2m1_decode(codes) * s).astype(np.float32)
    return codes.reshape(x.shape), (e[..., 0] + 127).astype(np.uint8), deq.reshape(x.shape)


def ref_fp4_e4m3(x: np.ndarray):
    g = ref_groups(x, 16)
    amax = np.maximum(np.abs(g).max(-1, keepdims=True), np.float32(6 * 2.0**-9))
    scale_codes = ref_float_to_e4m3(amax / np.float32(6))
    s = E4M3_TABLE[scale_codes].astype(np.float32)
    codes = ref_float_to_e2m1(np.clip(g / s, -6, 6))
    deq = (ref_e2m1_decode(codes) * s).astype(np.float32)
    return codes.reshape(x.shape), scale_codes[..., 0], deq.reshape(x.shape)


def ref_pack_nibbles(codes: np.ndarray) -> np.ndarray:
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def to_np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a)


def assert_same_bits(actual, expected):
    """Exact equality including the sign of zero and NaN positions."""
    actual = np.asarray(actual, dtype=np.float32)
    expected = np.asarray(expected, dtype=np.float32)
    assert actual.shape == expected.shape
    diff = actual.view(np.uint32) != expected.view(np.uint32)
    diff &= ~(np.isnan(actual) & np.isnan(expected))
    assert not diff.any(), (np.argwhere(diff)[:5], actual[diff][:5], expected[diff][:5])


def bf16_input(values) -> tuple[mx.array, np.ndarray]:
    """Values rounded to bf16 (the model's input dtype) and their exact fp32 numpy copy."""
    x = mx.array(np.asarray(values, dtype=np.float32)).astype(mx.bfloat16)
    return x, to_np(x)


def random_rows(shape, rng) -> np.ndarray:
    """Normal values with a per-16 magnitude spread of 2^-20 .. 2^12 and some exact zeros."""
    x = rng.standard_normal(shape).astype(np.float32)
    spread = rng.integers(-20, 13, size=(*shape[:-1], shape[-1] // 16, 1))
    x = (x.reshape(*shape[:-1], -1, 16) * np.ldexp(1.0, spread)).reshape(shape)
    x[rng.random(shape) < 0.02] = 0.0
    return x


# ---------------------------------------------------------------- E4M3

def test_e4m3_decodes_every_byte_from_bit_fields():
    actual = to_np(quant.e4m3_to_float(mx.arange(256).astype(mx.uint8)))
    assert_same_bits(actual, E4M3_TABLE)
    assert actual[0x7E] == 448.0 and actual[0x01] == 2.0**-9 and actual[0x08] == 2.0**-6
    assert np.isnan(actual[list(E4M3_NAN)]).all() and np.signbit(actual[0x80])


def test_e4m3_encode_round_trips_every_finite_code():
    finite = np.array([c for c in range(256) if c not in E4M3_NAN])
    values = mx.array(E4M3_TABLE[finite].astype(np.float32))
    np.testing.assert_array_equal(to_np(quant.float_to_e4m3(values)), finite)


def test_e4m3_midpoints_round_to_even_and_neighbours_to_nearest():
    lo, hi = E4M3_GRID[:-1], E4M3_GRID[1:]
    mid = ((lo + hi) / 2).astype(np.float32)  # exact: 5 significant bits
    below = np.nextafter(mid, np.float32(0))
    above = np.nextafter(mid, np.float32(np.inf))
    codes_lo = np.arange(len(lo))
    even = np.where(codes_lo % 2 == 0, codes_lo, codes_lo + 1)
    for values, expected in ((mid, even), (below, codes_lo), (above, codes_lo + 1)):
        for sign in (1, -1):
            got = to_np(quant.float_to_e4m3(mx.array(sign * values)))
            np.testing.assert_array_equal(got, expected | (0x80 if sign < 0 else 0))
            np.testing.assert_array_equal(got, ref_float_to_e4m3(sign * values))


def test_e4m3_saturates_and_keeps_sign():
    values = np.array([448, 449, 464, 479.9, 480, 1e6, 3e38, np.inf, -448, -464, -np.inf],
                      dtype=np.float32)
    expected = [0x7E] * 8 + [0xFE] * 3
    np.testing.assert_array_equal(to_np(quant.float_to_e4m3(mx.array(values))), expected)
    zeros = np.array([0.0, -0.0, -1e-30, -2.0**-11, 2.0**-11], dtype=np.float32)
    np.testing.assert_array_equal(to_np(quant.float_to_e4m3(mx.array(zeros))),
                                  [0x00, 0x80, 0x80, 0x80, 0x00])


def test_e4m3_subnormals():
    step = 2.0**-9
    k = np.arange(0, 9)
    exact = (k * step).astype(np.float32)
    ties = ((k[:-1] + 0.5) * step).astype(np.float32)
    got = to_np(quant.float_to_e4m3(mx.array(np.concatenate([exact, ties]))))
    np.testing.assert_array_equal(got[:9], k)  # 8 * 2^-9 is the min normal, code 0x08
    np.testing.assert_array_equal(got[9:], np.where(k[:-1] % 2 == 0, k[:-1], k[:-1] + 1))
    tiny = np.array([1e-45, 2.0**-10 * 1.0001, 2.0**-10 * 0.9999], dtype=np.float32)
    np.testing.assert_array_equal(to_np(quant.float_to_e4m3(mx.array(tiny))), [0, 1, 0])


def test_e4m3_encode_random_values_match_grid_search():
    rng = np.random.default_rng(RNG_SEED)
    x = (rng.standard_normal(50_000) * np.ldexp(1.0, rng.integers(-14, 11, 50_000)))
    x = x.astype(np.float32)
    np.testing.assert_array_equal(to_np(quant.float_to_e4m3(mx.array(x))), ref_float_to_e4m3(x))


# ---------------------------------------------------------------- E2M1, E8M0, nibbles

E2M1_TIES = [(0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6)]


@pytest.mark.parametrize("tie,code", E2M1_TIES)
def test_e2m1_ties_follow_numerics_table(tie, code):
    v = np.array([tie, -tie, np.nextafter(np.float32(tie), np.float32(0)),
                  np.nextafter(np.float32(tie), np.float32(7))], dtype=np.float32)
    got = to_np(quant.float_to_e2m1(mx.array(v)))
    assert got[0] == code and got[1] == code | 8
    np.testing.assert_array_equal(got, ref_float_to_e2m1(v))
    assert got[2] < got[3]  # either side of a threshold lands on the neighbouring codes


def test_e2m1_grid_zero_sign_and_decode():
    grid = np.concatenate([E2M1_MAGNITUDES, -E2M1_MAGNITUDES]).astype(np.float32)
    np.testing.assert_array_equal(to_np(quant.float_to_e2m1(mx.array(grid))), np.arange(16))
    near_zero = np.array([-0.0, -0.1, -0.25, 0.1], dtype=np.float32)
    np.testing.assert_array_equal(to_np(quant.float_to_e2m1(mx.array(near_zero))), [8, 8, 8, 0])
    decoded = to_np(quant.e2m1_to_float(mx.arange(16).astype(mx.uint8)))
    assert_same_bits(decoded, np.array(quant.FP4_TABLE, dtype=np.float32))
    assert_same_bits(decoded, ref_e2m1_decode(np.arange(16)))
    v = np.random.default_rng(RNG_SEED).uniform(-6, 6, 20_000).astype(np.float32)
    np.testing.assert_array_equal(to_np(quant.float_to_e2m1(mx.array(v))), ref_float_to_e2m1(v))


def test_e8m0_decodes_every_byte():
    got = to_np(quant.e8m0_to_float(mx.arange(256).astype(mx.uint8)))
    expected = np.array([math.ldexp(1.0, b - 127) for b in range(255)] + [math.nan], np.float32)
    assert_same_bits(got, expected)
    assert got[0] == np.float32(2.0**-127) and got[0] > 0  # fp32 subnormal, not flushed


def test_nibble_order_and_round_trip():
    codes = mx.array(np.array([[1, 2, 15, 0]], dtype=np.uint8))
    np.testing.assert_array_equal(to_np(quant.pack_nibbles(codes)), [[0x21, 0x0F]])
    rng = np.random.default_rng(RNG_SEED)
    codes = rng.integers(0, 16, (3, 5, 64), dtype=np.uint8)
    packed = quant.pack_nibbles(mx.array(codes))
    np.testing.assert_array_equal(to_np(packed), ref_pack_nibbles(codes))
    np.testing.assert_array_equal(to_np(quant.unpack_nibbles(packed)), codes)


# ---------------------------------------------------------------- act_fp8

@pytest.mark.parametrize("k", [-20, -3, 0, 1, 7, 100])
def test_act_fp8_scale_at_power_of_two_boundary(k):
    edge = 448.0 * 2.0**k  # amax * fp32(1/448) rounds to exactly 2^k: scale 2^k
    rows = np.zeros((3, 32), dtype=np.float32)
    rows[:, 1:] = np.linspace(-edge / 2, edge / 2, 31)
    rows[0, 0] = edge
    rows[1, 0] = -np.nextafter(np.float32(edge), np.float32(np.inf))
    rows[2, 0] = edge * (1 + 2.0**-7)  # next bf16 above the boundary
    for x in (mx.array(rows), mx.array(rows[[0, 2]]).astype(mx.bfloat16)):  # fp32 keeps row 1
        xn = to_np(x)
        codes, scale_bytes = fp8.act_fp8_quantize(x)
        ref_codes, ref_bytes, ref_deq = ref_act_fp8(xn)
        expected = [127 + k, 128 + k, 128 + k] if x.dtype == mx.float32 else [127 + k, 128 + k]
        np.testing.assert_array_equal(to_np(scale_bytes)[:, 0], expected)
        np.testing.assert_array_equal(to_np(scale_bytes), ref_bytes)
        np.testing.assert_array_equal(to_np(codes), ref_codes)
        assert_same_bits(to_np(fp8.act_fp8_qdq(x)), ref_deq)


def test_act_fp8_amax_floor_zeros_and_tiny():
    rows = np.zeros((4, 64), dtype=np.float32)
    rows[0, 32:] = -0.0
    rows[1] = 1e-6 * np.linspace(-1, 1, 64)
    rows[2, :32] = 1e-4  # exactly the floor
    rows[3] = 1e-30
    x, xn = bf16_input(rows)
    codes, scale_bytes = fp8.act_fp8_quantize(x)
    ref_codes, ref_bytes, ref_deq = ref_act_fp8(xn)
    floor_exponent = ref_ceil_log2(np.float32(1e-4) * np.float32(1 / 448))
    assert (to_np(scale_bytes)[0] == 127 + floor_exponent).all() and floor_exponent == -22
    np.testing.assert_array_equal(to_np(scale_bytes), ref_bytes)
    np.testing.assert_array_equal(to_np(codes), ref_codes)
    out = fp8.act_fp8_qdq(x)
    assert out.dtype == mx.bfloat16
    assert_same_bits(to_np(out), ref_deq)
    assert np.signbit(to_np(out)[0, 32:]).all()


def test_act_fp8_random_any_leading_shape():
    rng = np.random.default_rng(RNG_SEED)
    for shape in [(96,), (3, 5, 512), (2, 1, 3, 64)]:
        x, xn = bf16_input(random_rows(shape, rng))
        ref_codes, ref_bytes, ref_deq = ref_act_fp8(xn)
        codes, scale_bytes = fp8.act_fp8_quantize(x)
        np.testing.assert_array_equal(to_np(codes), ref_codes)
        np.testing.assert_array_equal(to_np(scale_bytes), ref_bytes)
        assert_same_bits(to_np(fp8.act_fp8_qdq(x)), ref_deq)
    x32 = mx.array(xn)
    assert fp8.act_fp8_qdq(x32).dtype == mx.float32
    assert_same_bits(to_np(fp8.act_fp8_qdq(x32)), ref_deq)


def all_finite_bf16(order: str) -> np.ndarray:
    """Every finite bf16 value once (65,280 of them) as fp32, padded to rows of 512 with zeros;
    "sorted" puts like magnitudes in one group, "shuffled" mixes them."""
    bits = np.arange(1 << 16, dtype=np.uint32) << 16
    values = bits.view(np.float32)
    values = values[np.isfinite(values)]
    if order == "sorted":
        values = values[np.argsort(np.abs(values), kind="stable")]
    else:
        values = np.random.default_rng(RNG_SEED).permutation(values)
    return np.concatenate([values, np.zeros(-len(values) % 512, np.float32)]).reshape(-1, 512)


@pytest.mark.parametrize("order", ["sorted", "shuffled"])
def test_every_bf16_value_through_all_three_functions(order):
    x, xn = bf16_input(all_finite_bf16(order))
    with np.errstate(over="ignore", invalid="ignore"):  # huge groups: s up to 2^126
        refs = [ref_act_fp8(xn), ref_fp4_e8m0(xn), ref_fp4_e4m3(xn)]
    outs = [fp8.act_fp8_qdq(x), quant.fp4_e8m0_qdq(x), quant.fp4_e4m3_qdq(x)]
    for out, (_, _, ref_deq) in zip(outs, refs):
        assert_same_bits(to_np(out), ref_deq)  # exact: every QDQ value fits bf16
    np.testing.assert_array_equal(to_np(fp8.act_fp8_quantize(x)[0]), refs[0][0])


# ---------------------------------------------------------------- FP4 fake-quant

def adversarial_rows(width: int, group: int, scale: float) -> np.ndarray:
    """Rows whose groups hit zeros, -0, tiny values, E2M1 ties, saturation, mixed sign."""
    ties = np.array([t for t, _ in E2M1_TIES] + [-t for t, _ in E2M1_TIES], dtype=np.float32)
    rows = []
    for kind in range(6):
        row = np.zeros(width, dtype=np.float32)
        for g in range(width // group):
            seg = row[g * group:(g + 1) * group]
            if kind == 1:
                seg[:] = -0.0
            elif kind == 2:
                seg[:] = np.float32(1e-38) * (g + 1) * np.resize([1, -1, 0.5], group)
            elif kind == 3:  # amax 6 * scale, ties at exactly 1 * scale
                seg[:] = np.resize(np.concatenate([[6.0], ties]), group) * scale
            elif kind == 4:
                seg[:] = np.resize([3e4, -2.5e5, 1.0, -0.0], group) * (g + 1)
            elif kind == 5:  # a group max just past a scale boundary
                seg[:] = np.resize([6.375, 5.0, -0.3, 0.2], group) * scale * 2.0**g
        rows.append(row)
    return np.stack(rows)


def check_fp4_e8m0(x: mx.array, xn: np.ndarray):
    ref_codes, ref_bytes, ref_deq = ref_fp4_e8m0(xn)
    out = quant.fp4_e8m0_qdq(x)
    assert out.dtype == x.dtype
    assert_same_bits(to_np(out), ref_deq)
    packed = quant.pack_fp4_e8m0(x)
    expected = np.concatenate([ref_pack_nibbles(ref_codes), ref_bytes], axis=-1)
    np.testing.assert_array_equal(to_np(packed), expected)
    unpacked = quant.unpack_fp4_e8m0(packed, dtype=x.dtype)
    assert_same_bits(to_np(unpacked), to_np(out))


def check_fp4_e4m3(x: mx.array, xn: np.ndarray):
    ref_codes, ref_scales, ref_deq = ref_fp4_e4m3(xn)
    out = quant.fp4_e4m3_qdq(x)
    assert out.dtype == x.dtype
    assert_same_bits(to_np(out), ref_deq)
    packed = quant.pack_fp4_e4m3(x)
    expected = np.concatenate([ref_pack_nibbles(ref_codes), ref_scales], axis=-1)
    np.testing.assert_array_equal(to_np(packed), expected)
    unpacked = quant.unpack_fp4_e4m3(packed, dtype=x.dtype)
    assert_same_bits(to_np(unpacked), to_np(out))


@pytest.mark.parametrize("scale", [1.0, 2.0**-40, 2.0**30])
def test_fp4_e8m0_adversarial_rows(scale):
    x, xn = bf16_input(adversarial_rows(128, 32, scale))
    check_fp4_e8m0(x, xn)


@pytest.mark.parametrize("scale", [1.0, 2.0**-6, 0.75, 40.0])
def test_fp4_e4m3_adversarial_rows(scale):
    x, xn = bf16_input(adversarial_rows(512, 16, scale))
    check_fp4_e4m3(x, xn)


def test_fp4_e4m3_scale_rounding_and_saturation():
    rows = np.zeros((4, 16), dtype=np.float32)
    rows[0, :2] = [6.375, -6.375]  # amax/6 = 1.0625 ties to scale 1.0; clamp saves the max
    rows[1, :2] = [1e5, -0.5]  # scale saturates at 448; values clamp at 6 * 448
    rows[2, :2] = [6 * 2.0**-9, 2.0**-9]  # exactly the amax floor
    rows[3, :] = 1e-20  # below the floor: scale stays 2^-9, everything rounds to 0
    x, xn = bf16_input(rows)
    out = to_np(quant.fp4_e4m3_qdq(x))
    np.testing.assert_array_equal(out[0, :2], [6.0, -6.0])
    np.testing.assert_array_equal(out[1, :2], [2688.0, 0.0])
    assert np.signbit(out[1, 1])
    np.testing.assert_array_equal(out[2, :2], [6 * 2.0**-9, 2.0**-9])
    np.testing.assert_array_equal(out[3], 0.0)
    packed = to_np(quant.pack_fp4_e4m3(x))
    np.testing.assert_array_equal(packed[:, 8], [0x38, 0x7E, 0x01, 0x01])
    check_fp4_e4m3(x, xn)


def test_fp4_e4m3_scale_uses_true_division():
    # amax / 6 = 1.1874999 rounds to 1.125, while amax * fp32(1/6) = 1.1875 would tie up to 1.25.
    amax = np.nextafter(np.float32(7.125), np.float32(0))
    rows = np.zeros((2, 16), dtype=np.float32)
    rows[:, 0] = [amax, 7.125]
    x = mx.array(rows)
    np.testing.assert_array_equal(to_np(quant.pack_fp4_e4m3(x))[:, 8], [0x39, 0x3A])
    check_fp4_e4m3(x, rows)


def test_fp4_e8m0_floor_and_ties():
    rows = np.zeros((3, 32), dtype=np.float32)
    rows[0, :8] = [6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5]  # scale 1: table ties
    rows[1, :2] = [1e-39, -1e-39]  # below the floor: scale 2^-126
    rows[2, :] = -0.0
    x, xn = bf16_input(rows)
    out = to_np(quant.fp4_e8m0_qdq(x))
    np.testing.assert_array_equal(out[0, :8], [6, 0, 1, 1, 2, 2, 4, 4])
    packed = to_np(quant.pack_fp4_e8m0(x))
    np.testing.assert_array_equal(packed[:, 16], [127, 1, 1])
    assert np.signbit(out[2]).all()
    check_fp4_e8m0(x, xn)


@pytest.mark.parametrize("shape", [(512,), (7, 512), (2, 3, 5, 512)])
def test_pack_fp4_e4m3_random_rows(shape):
    x, xn = bf16_input(random_rows(shape, np.random.default_rng(RNG_SEED)))
    packed = quant.pack_fp4_e4m3(x)
    assert packed.dtype == mx.uint8 and packed.shape == (*shape[:-1], 288)
    check_fp4_e4m3(x, xn)


@pytest.mark.parametrize("shape", [(128,), (5, 32, 128), (1, 3, 1, 128)])
def test_pack_fp4_e8m0_random_rows(shape):
    x, xn = bf16_input(random_rows(shape, np.random.default_rng(RNG_SEED)))
    packed = quant.pack_fp4_e8m0(x)
    assert packed.dtype == mx.uint8 and packed.shape == (*shape[:-1], 68)
    check_fp4_e8m0(x, xn)


def test_pack_fp8_e8m0_window_rows():
    x, xn = bf16_input(random_rows((3, 7, 512), np.random.default_rng(RNG_SEED)))
    packed = fp8.pack_fp8_e8m0(x)
    assert packed.dtype == mx.uint8 and packed.shape == (3, 7, 528)
    ref_codes, ref_bytes, ref_deq = ref_act_fp8(xn)
    np.testing.assert_array_equal(to_np(packed), np.concatenate([ref_codes, ref_bytes], -1))
    assert_same_bits(to_np(quant.unpack_fp8_e8m0(packed)), ref_deq)


def test_unpack_rejects_bad_row_width():
    with pytest.raises(ValueError):
        quant.unpack_fp4_e4m3(mx.zeros((2, 287), dtype=mx.uint8))
    with pytest.raises(ValueError):
        fp8.act_fp8_qdq(mx.zeros((2, 48)))


# ---------------------------------------------------------------- weights and MLX layouts

def random_fp8_weight(rng, n, k, scale_range=(0, 255)):
    w = rng.integers(0, 256, (n, k), dtype=np.uint8)
    w[(w & 0x7F) == 0x7F] ^= 0x01  # no NaN codes
    s = rng.integers(*scale_range, (-(-n // 32), -(-k // 32)), dtype=np.uint8)
    return w, s


def ref_dequant_fp8(w, s):
    n, k = w.shape
    rows, cols = np.arange(n)[:, None] // 32, np.arange(k)[None, :] // 32
    return (E4M3_TABLE[w] * np.ldexp(1.0, s[rows, cols].astype(np.int64) - 127)).astype(np.float32)


def ref_dequant_fp4(w, s):
    codes = np.stack([w & 0xF, w >> 4], axis=-1).reshape(*w.shape[:-1], 2 * w.shape[-1])
    k = np.arange(codes.shape[-1]) // 32
    scale = np.ldexp(1.0, s[..., k].astype(np.int64) - 127)
    with np.errstate(over="ignore"):  # 6 * 2^127 overflows fp32 to inf, as in MLX
        return (ref_e2m1_decode(codes) * scale).astype(np.float32)


@pytest.mark.parametrize("n,k", [(64, 96), (70, 100)])
def test_dequant_fp8_blocks(n, k):
    w, s = random_fp8_weight(np.random.default_rng(RNG_SEED), n, k, (100, 150))
    expected = ref_dequant_fp8(w, s)
    got = quant.dequant_fp8_blocks(mx.array(w), mx.array(s), mx.float32)
    assert_same_bits(to_np(got), expected)
    bf = quant.dequant_fp8_blocks(mx.array(w), mx.array(s))
    assert bf.dtype == mx.bfloat16
    assert_same_bits(to_np(bf), expected)  # E4M3 * 2^k is exact in bf16


def test_dequant_fp4_rows():
    rng = np.random.default_rng(RNG_SEED)
    w = rng.integers(0, 256, (3, 40, 64), dtype=np.uint8)
    s = rng.integers(100, 150, (3, 40, 4), dtype=np.uint8)
    got = quant.dequant_fp4_rows(mx.array(w), mx.array(s))
    assert got.shape == (3, 40, 128) and got.dtype == mx.bfloat16
    assert_same_bits(to_np(got), ref_dequant_fp4(w, s))


def test_mxfp8_layout_dequantizes_bit_exactly_and_multiplies():
    rng = np.random.default_rng(RNG_SEED)
    w, s = random_fp8_weight(rng, 80, 256)  # full E8M0 range: subnormal and inf products too
    w_u32, scales = quant.fp8_blocks_to_mxfp8(mx.array(w), mx.array(s))
    assert w_u32.dtype == mx.uint32 and w_u32.shape == (80, 64) and scales.shape == (80, 8)
    mlx_deq = mx.dequantize(w_u32, scales, group_size=32, bits=8, mode="mxfp8", dtype=mx.float32)
    with np.errstate(over="ignore"):
        assert_same_bits(to_np(mlx_deq), ref_dequant_fp8(w, s))
    w, s = random_fp8_weight(rng, 80, 256, (118, 126))
    w_u32, scales = quant.fp8_blocks_to_mxfp8(mx.array(w), mx.array(s))
    check_quantized_matmul(w_u32, scales, ref_dequant_fp8(w, s), bits=8, mode="mxfp8")


def test_mxfp4_layout_dequantizes_bit_exactly_and_multiplies():
    rng = np.random.default_rng(RNG_SEED)
    w = rng.integers(0, 256, (2, 48, 128), dtype=np.uint8)
    s = rng.integers(0, 255, (2, 48, 8), dtype=np.uint8)
    w_u32, scales = quant.fp4_to_mxfp4(mx.array(w), mx.array(s))
    assert w_u32.dtype == mx.uint32 and w_u32.shape == (2, 48, 32)
    mlx_deq = mx.dequantize(w_u32, scales, group_size=32, bits=4, mode="mxfp4", dtype=mx.float32)
    assert_same_bits(to_np(mlx_deq), ref_dequant_fp4(w, s))
    s = rng.integers(118, 126, (2, 48, 8), dtype=np.uint8)
    w_u32, scales = quant.fp4_to_mxfp4(mx.array(w), mx.array(s))
    check_quantized_matmul(w_u32[1], scales[1], ref_dequant_fp4(w, s)[1], bits=4, mode="mxfp4")


def check_quantized_matmul(w_u32, scales, dense, bits, mode):
    """quantized_matmul on an fp32 activation == x @ W.T to fp32 summation-order error."""
    x = np.random.default_rng(RNG_SEED).standard_normal((5, dense.shape[1])).astype(np.float32)
    y = mx.quantized_matmul(mx.array(x), w_u32, scales, transpose=True, group_size=32,
                            bits=bits, mode=mode)
    expected = x.astype(np.float64) @ dense.T.astype(np.float64)
    bound = np.abs(x).astype(np.float64) @ np.abs(dense.T).astype(np.float64)
    assert (np.abs(to_np(y) - expected) <= 1e-5 * bound).all()
