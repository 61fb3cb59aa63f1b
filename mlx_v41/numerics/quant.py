"""FP8 E4M3 / FP4 E2M1 / E8M0 element formats and the reference's fake-quant functions.

Bit-exact MLX ops for `act_quant` (act_fp8), `fp4_act_quant` (fp4_e8m0, fp4_e4m3), the packed
cache rows (byte layouts below), checkpoint weight dequantisation and the
conversion of checkpoint FP8/FP4 weights to MLX's mxfp8/mxfp4 quantized layout.
Every function works on any leading shape; groups run along the last axis.
"""

import functools

import mlx.core as mx

FP8_E4M3_MAX = 448.0  # largest finite E4M3FN value (0x7E)
FP4_E2M1_MAX = 6.0  # largest E2M1 magnitude
E8M0_BIAS = 127  # E8M0 byte b encodes 2^(b - 127)
FP8_NAN_CODE = 0x7F  # E4M3FN NaN (S.1111.111); no infinities
ACT_FP8_BLOCK = 32  # act_fp8 group along the last axis
FP4_E8M0_BLOCK = 32  # index key/query FP4 group
FP4_E4M3_BLOCK = 16  # compressed main-KV FP4 group
WEIGHT_BLOCK = 32  # FP8 weight 32x32 blocks; FP4 expert 1x32 groups
ACT_FP8_AMAX_FLOOR = 1e-4  # keeps the scale of an all-zero group finite
FP4_E8M0_AMAX_FLOOR = 6.0 * 2.0**-126  # scale never below 2^-126
FP4_E4M3_AMAX_FLOOR = 6.0 * 2.0**-9  # scale never below the smallest E4M3 subnormal

FP4_TABLE = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
             -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # E2M1 decode by code
# E2M1 magnitude thresholds as (threshold, is the tie rounded up): one
# code step each; a tie goes to the even code, so it rounds up only when the upper code is even.
_E2M1_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True),
               (2.5, False), (3.5, True), (5.0, False))
_F32_MANT_BITS = 23


def _bits(x: mx.array) -> mx.array:
    return mx.view(x.astype(mx.float32), mx.uint32)


def _pow2(e: mx.array) -> mx.array:
    """Exact 2^e for int32 e in [-127, 127], built from the fp32 bit pattern."""
    biased = (e + 127).astype(mx.uint32)
    bits = mx.where(biased == 0, mx.array(0x400000, mx.uint32), biased << _F32_MANT_BITS)
    return mx.view(bits, mx.float32)


def _groups(x: mx.array, size: int) -> mx.array:
    *lead, k = x.shape
    if k % size:
        raise ValueError(f"last dimension {k} is not a multiple of the group size {size}")
    return x.reshape(*lead, k // size, size)


# ---------------------------------------------------------------- element formats

def e4m3_to_float(codes: mx.array) -> mx.array:
    """Decode E4M3FN bytes (any shape) to float32; 0x7F / 0xFF decode to NaN."""
    return mx.from_fp8(codes.astype(mx.uint8), mx.float32)


def float_to_e4m3(x: mx.array) -> mx.array:
    """Encode to E4M3FN: clamp to +-448, then round to nearest, ties to even (saturating).

    MLX's `to_fp8` is this rounding (tests/test_quant.py checks every bf16 value and every
    midpoint against an independent encoder); -0 and negatives that round to zero keep the sign
    bit; NaN -> 0x7F.
    """
    x = x.astype(mx.float32)
    code = mx.to_fp8(mx.clip(x, -FP8_E4M3_MAX, FP8_E4M3_MAX))
    return mx.where(mx.isnan(x), mx.array(FP8_NAN_CODE, mx.uint8), code)


def _round_e4m3(x: mx.array) -> mx.array:
    """fp32 values rounded onto the E4M3 grid (saturating RNE), for non-NaN x (the QDQ path)."""
    return mx.from_fp8(mx.to_fp8(mx.clip(x, -FP8_E4M3_MAX, FP8_E4M3_MAX)), mx.float32)


def _round_e2m1(v: mx.array) -> mx.array:
    """fp32 values in [-6, 6] rounded onto the E2M1 grid with the even-code tie rule.

    Below 1 the grid is {0, 0.5, 1}: RNE of 2v. From 1 up it is a float with one mantissa
    bit, and ties to the even code are ties to the even mantissa: RNE of the fp32 mantissa to
    one bit (1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4).
    """
    a = mx.abs(v)
    bits = _bits(a)
    high = mx.view((bits + 0x1FFFFF + ((bits >> 22) & 1)) & 0xFFC00000, mx.float32)
    magnitude = mx.where(a < 1.0, mx.round(a * 2.0) * 0.5, high)
    return mx.where((_bits(v) >> 31) != 0, -magnitude, magnitude)


def _pow2_ceil(t: mx.array) -> mx.array:
    """2^ceil(log2 t) for normal positive fp32 t: carry a non-zero mantissa into the exponent."""
    return mx.view((_bits(t) + 0x7FFFFF) & 0xFF800000, mx.float32)


def e2m1_to_float(codes: mx.array) -> mx.array:
    """Decode E2M1 codes 0..15 (bit 3 = sign) to float32, the values of FP4_TABLE."""
    c = codes.astype(mx.int32)
    exponent = (c >> 1) & 0x3
    mantissa = c & 0x1
    # Arithmetic rather than a table gather, so the decode fuses under mx.compile.
    significand = mx.where(exponent == 0, mantissa, mantissa + 2).astype(mx.float32)
    value = significand * _pow2(mx.maximum(exponent, 1) - 2)
    return mx.where((c & 0x8) != 0, -value, value)


def float_to_e2m1(v: mx.array) -> mx.array:
    """Encode fp32 values already clamped to [-6, 6] to E2M1 codes 0..15.

    Nearest grid value, ties to the even code; the sign bit is kept when
    the magnitude rounds to zero.
    """
    v = v.astype(mx.float32)
    a = mx.abs(v)
    magnitude = mx.zeros(v.shape, dtype=mx.uint8)
    for threshold, is_tie_up in _E2M1_STEPS:
        above = (a >= threshold) if is_tie_up else (a > threshold)
        magnitude = magnitude + above.astype(mx.uint8)
    sign = ((_bits(v) >> 31) << 3).astype(mx.uint8)
    return magnitude | sign


@functools.cache
def _e8m0_table() -> mx.array:
    b = mx.arange(256).astype(mx.uint32)
    extra = mx.where((b == 0) | (b == 255), mx.array(0x400000, mx.uint32), mx.array(0, mx.uint32))
    table = mx.view((b << _F32_MANT_BITS) | extra, mx.float32)
    mx.eval(table)
    return table


def e8m0_to_float(b: mx.array) -> mx.array:
    """Decode E8M0 scale bytes to float32 2^(b - 127) (exact, incl. 2^-127); 255 -> NaN."""
    return _e8m0_table()[b if b.dtype == mx.uint8 else b.astype(mx.uint32)]


def pack_nibbles(codes: mx.array) -> mx.array:
    """Pack 4-bit codes [..., 2n] into bytes [..., n]: element 2i low nibble, 2i+1 high."""
    pairs = _groups(codes.astype(mx.uint8), 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nibbles(packed: mx.array) -> mx.array:
    """Inverse of pack_nibbles: bytes [..., n] -> codes [..., 2n] uint8."""
    packed = packed.astype(mx.uint8)
    pairs = mx.stack([packed & 0xF, packed >> 4], axis=-1)
    return pairs.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


# ---------------------------------------------------------------- fake-quant functions

def _exponent_byte(scale: mx.array, shift: int = 0) -> mx.array:
    """E8M0 byte of a power-of-two fp32 scale (`shift`: of 2^shift times it)."""
    return ((_bits(scale[..., 0]) >> _F32_MANT_BITS) + shift).astype(mx.uint8)


def _fp4_e8m0_parts(x: mx.array):
    """fp4_e8m0 on groups [..., G, 32]: clamp(x / s) (not yet rounded) and s = 2^e."""
    g = _groups(x, FP4_E8M0_BLOCK).astype(mx.float32)
    amax = mx.maximum(mx.abs(g).max(axis=-1, keepdims=True), FP4_E8M0_AMAX_FLOOR)
    scale = _pow2_ceil(amax * mx.array(1.0 / FP4_E2M1_MAX, dtype=mx.float32))  # as in act_fp8
    return mx.clip(g / scale, -FP4_E2M1_MAX, FP4_E2M1_MAX), scale


def fp4_e8m0_qdq(x: mx.array) -> mx.array:
    """FP4 E2M1 with power-of-two scale per 32 (indexer q and k); returns x.dtype. Compiled
    (the indexer's queries run it every decode step; uncompiled it is 27 ops)."""
    _check_groups(x, FP4_E8M0_BLOCK)
    return _compiled(_fp4_e8m0_qdq)(x)


def _fp4_e8m0_qdq(x: mx.array) -> mx.array:
    scaled, scale = _fp4_e8m0_parts(x)
    return (_round_e2m1(scaled) * scale).astype(x.dtype).reshape(x.shape)


def _fp4_e4m3_parts(x: mx.array):
    """fp4_e4m3 on groups [..., G, 16]: clamp(x / s) (not yet rounded) and the E4M3 scale."""
    g = _groups(x, FP4_E4M3_BLOCK).astype(mx.float32)
    amax = mx.maximum(mx.abs(g).max(axis=-1, keepdims=True), FP4_E4M3_AMAX_FLOOR)
    scale = _round_e4m3(amax / FP4_E2M1_MAX)
    # True division: the scale is not a power of two, and it may have rounded below amax / 6.
    return mx.clip(g / scale, -FP4_E2M1_MAX, FP4_E2M1_MAX), scale


def fp4_e4m3_qdq(x: mx.array) -> mx.array:
    """FP4 E2M1 with an E4M3 scale per 16 (compressed main KV); returns x.dtype. Compiled."""
    _check_groups(x, FP4_E4M3_BLOCK)
    return _compiled(_fp4_e4m3_qdq)(x)


def _fp4_e4m3_qdq(x: mx.array) -> mx.array:
    scaled, scale = _fp4_e4m3_parts(x)
    return (_round_e2m1(scaled) * scale).astype(x.dtype).reshape(x.shape)


# ---------------------------------------------------------------- packed cache rows
# Row layouts, little-endian bytes, row-contiguous:
#   fp4_e4m3 (main KV, 512 -> 288 B): K/2 code bytes (element 2b low nibble, 2b+1 high),
#       then K/16 E4M3FN scale bytes, byte K/2 + g scaling elements 16g .. 16g+15.
#   fp4_e8m0 (index key, 128 -> 68 B): K/2 code bytes, then K/32 E8M0 bytes (2^(b-127)).
#   fp8_e8m0 (window ring, 512 -> 528 B): K E4M3FN bytes, then K/32 E8M0 bytes.

def _row_width(nbytes: int, num: int, den: int, name: str) -> int:
    if (nbytes * den) % num:
        raise ValueError(f"{name}: a packed row of {nbytes} bytes is not a valid width")
    return nbytes * den // num


def _compiled(fn, **static):
    """`fn` compiled once per static argument set: a packed row's encode / decode is a chain
    of element-wise ops that `mx.compile` fuses (shapes are checked before, outside it)."""
    return _compiled_cache(fn, tuple(sorted(static.items())))


@functools.cache
def _compiled_cache(fn, static: tuple):
    return mx.compile(functools.partial(fn, **dict(static)))


def _check_groups(x: mx.array, size: int) -> None:
    if x.shape[-1] % size:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of the group size "
                         f"{size}")


def pack_fp4_e4m3(x: mx.array) -> mx.array:
    """Encode with fp4_e4m3 into packed rows: [..., K] -> uint8 [..., K/2 + K/16]."""
    _check_groups(x, FP4_E4M3_BLOCK)
    return _compiled(_pack_fp4_e4m3)(x)


def _pack_fp4_e4m3(x: mx.array) -> mx.array:
    scaled, scale = _fp4_e4m3_parts(x)
    codes = pack_nibbles(float_to_e2m1(scaled).reshape(x.shape))
    return mx.concatenate([codes, mx.to_fp8(scale[..., 0])], axis=-1)


@functools.cache
def _byte_pairs() -> mx.array:
    """[256, 2] fp32: the two E2M1 values a packed byte holds (low nibble first)."""
    table = mx.array(FP4_TABLE, dtype=mx.float32)
    byte = mx.arange(256)
    pairs = mx.stack([table[byte & 0xF], table[byte >> 4]], axis=-1)
    mx.eval(pairs)
    return pairs


def _decode_codes(packed_codes: mx.array) -> mx.array:
    """Packed E2M1 bytes [..., n] -> fp32 values [..., 2n] with one table lookup (the decode
    runs on every selected row of every step; a table gather is one op, the bit form ~10)."""
    codes = packed_codes if packed_codes.dtype == mx.uint8 else packed_codes.astype(mx.uint32)
    values = _byte_pairs()[codes]  # a uint8 index needs no cast
    return values.reshape(*packed_codes.shape[:-1], 2 * packed_codes.shape[-1])


def unpack_fp4_e4m3(packed: mx.array, dtype=mx.bfloat16) -> mx.array:
    """Decode fp4_e4m3 rows: uint8 [..., 9K/16] -> [..., K] in dtype (== fp4_e4m3_qdq)."""
    _row_width(packed.shape[-1], 9, 16, "unpack_fp4_e4m3")
    return _compiled(_unpack_fp4_e4m3, dtype=dtype)(packed)


def _unpack_fp4_e4m3(packed: mx.array, dtype) -> mx.array:
    k = packed.shape[-1] * 16 // 9
    scale = e4m3_to_float(packed[..., k // 2:])[..., None]
    values = _groups(_decode_codes(packed[..., : k // 2]), FP4_E4M3_BLOCK) * scale
    return values.astype(dtype).reshape(*packed.shape[:-1], k)  # cast first: one fused kernel


def pack_fp4_e8m0(x: mx.array) -> mx.array:
    """Encode with fp4_e8m0 into packed rows: [..., K] -> uint8 [..., K/2 + K/32]."""
    _check_groups(x, FP4_E8M0_BLOCK)
    return _compiled(_pack_fp4_e8m0)(x)


def _pack_fp4_e8m0(x: mx.array) -> mx.array:
    scaled, scale = _fp4_e8m0_parts(x)
    codes = pack_nibbles(float_to_e2m1(scaled).reshape(x.shape))
    return mx.concatenate([codes, _exponent_byte(scale)], axis=-1)


def unpack_fp4_e8m0(packed: mx.array, dtype=mx.bfloat16) -> mx.array:
    """Decode fp4_e8m0 rows: uint8 [..., 17K/32] -> [..., K] in dtype (== fp4_e8m0_qdq)."""
    _row_width(packed.shape[-1], 17, 32, "unpack_fp4_e8m0")
    return _compiled(_unpack_fp4_e8m0, dtype=dtype)(packed)


def _unpack_fp4_e8m0(packed: mx.array, dtype) -> mx.array:
    k = packed.shape[-1] * 32 // 17
    scale = e8m0_to_float(packed[..., k // 2:])[..., None]
    values = _groups(_decode_codes(packed[..., : k // 2]), FP4_E8M0_BLOCK) * scale
    return values.astype(dtype).reshape(*packed.shape[:-1], k)


def unpack_fp8_e8m0(packed: mx.array, dtype=mx.bfloat16) -> mx.array:
    """Decode act_fp8 rows: uint8 [..., 33K/32] -> [..., K] in dtype (== act_fp8_qdq)."""
    _row_width(packed.shape[-1], 33, 32, "unpack_fp8_e8m0")
    return _compiled(_unpack_fp8_e8m0, dtype=dtype)(packed)


def _unpack_fp8_e8m0(packed: mx.array, dtype) -> mx.array:
    k = packed.shape[-1] * 32 // 33
    values = _groups(e4m3_to_float(packed[..., :k]), ACT_FP8_BLOCK)
    values = values * e8m0_to_float(packed[..., k:])[..., None]
    return values.astype(dtype).reshape(*packed.shape[:-1], k)


# ---------------------------------------------------------------- checkpoint weights

def _expand_blocks(scale: mx.array, n: int, k: int) -> mx.array:
    """[ceil(N/32), ceil(K/32)] block scales -> [N, K] per element."""
    full = mx.repeat(mx.repeat(scale, WEIGHT_BLOCK, axis=0), WEIGHT_BLOCK, axis=1)
    return full[:n, :k]


def _check_block_scale(weight: mx.array, scale: mx.array) -> None:
    n, k = weight.shape
    expected = (-(-n // WEIGHT_BLOCK), -(-k // WEIGHT_BLOCK))
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"FP8 weight {weight.shape} needs a block scale {expected}, got {scale.shape}")


def dequant_fp8_blocks(weight_u8: mx.array, scale_u8: mx.array, dtype=mx.bfloat16) -> mx.array:
    """Dequantise an FP8 weight with 32x32 E8M0 block scales.

    Args:
        weight_u8: [N, K] uint8 E4M3FN bytes.
        scale_u8: [ceil(N/32), ceil(K/32)] uint8 E8M0 bytes.
        dtype: output dtype (exact in bf16 for in-range scales).
    Returns:
        [N, K] array: E4M3(w[n, k]) * 2^(S[n//32, k//32] - 127).
    """
    _check_block_scale(weight_u8, scale_u8)
    n, k = weight_u8.shape
    scale = e8m0_to_float(_expand_blocks(scale_u8, n, k))
    return (e4m3_to_float(weight_u8) * scale).astype(dtype)


def dequant_fp4_rows(weight_u8: mx.array, scale_u8: mx.array, dtype=mx.bfloat16) -> mx.array:
    """Dequantise packed FP4 expert weights with per-row E8M0 scales per 32 along K.

    Args:
        weight_u8: [..., N, K/2] uint8, element 2i in the low nibble.
        scale_u8: [..., N, K/32] uint8 E8M0 bytes.
        dtype: output dtype.
    Returns:
        [..., N, K] array: FP4_TABLE[code] * 2^(S[n, k//32] - 127).
    """
    codes = unpack_nibbles(weight_u8)
    values = _groups(e2m1_to_float(codes), WEIGHT_BLOCK) * e8m0_to_float(scale_u8)[..., None]
    return values.reshape(codes.shape).astype(dtype)


def fp8_blocks_to_mxfp8(weight_u8: mx.array, scale_u8: mx.array):
    """Re-express an FP8 32x32-block weight in MLX's mxfp8 layout (exact, no re-rounding).

    MLX mxfp8 stores E4M3FN bytes in uint32 words, element j in byte j (little-endian), with
    one E8M0 byte per 32 along K; repeating each block scale for its 32 rows is lossless.

    Args:
        weight_u8: [N, K] uint8 E4M3FN bytes, K a multiple of 32.
        scale_u8: [ceil(N/32), K/32] uint8 E8M0 bytes.
    Returns:
        (w_u32 [N, K/4] uint32, scales_u8 [N, K/32] uint8) for
        mx.quantized_matmul(..., mode="mxfp8", group_size=32, bits=8).
    """
    _check_block_scale(weight_u8, scale_u8)
    n, k = weight_u8.shape
    if k % WEIGHT_BLOCK:
        raise ValueError(f"mxfp8 needs K a multiple of {WEIGHT_BLOCK}, got {k}")
    scales = mx.repeat(scale_u8, WEIGHT_BLOCK, axis=0)[:n]
    return mx.view(weight_u8.astype(mx.uint8), mx.uint32), scales.astype(mx.uint8)


def fp4_to_mxfp4(weight_u8: mx.array, scale_u8: mx.array):
    """Re-express packed FP4 expert weights in MLX's mxfp4 layout (a pure reinterpretation).

    MLX mxfp4 packs element j of a uint32 word in bits 4j..4j+3, which on little-endian bytes
    is the checkpoint's order (element 2i low nibble of byte i); scales are identical.

    Args:
        weight_u8: [..., N, K/2] uint8, K a multiple of 32.
        scale_u8: [..., N, K/32] uint8 E8M0 bytes.
    Returns:
        (w_u32 [..., N, K/8] uint32, scales_u8 [..., N, K/32] uint8) for mode="mxfp4".
    """
    half_k = weight_u8.shape[-1]
    expected_scale = (*weight_u8.shape[:-1], 2 * half_k // WEIGHT_BLOCK)
    if (2 * half_k) % WEIGHT_BLOCK or tuple(scale_u8.shape) != expected_scale:
        raise ValueError(f"FP4 weight {weight_u8.shape} and scale {scale_u8.shape} do not match")
    return mx.view(weight_u8.astype(mx.uint8), mx.uint32), scale_u8.astype(mx.uint8)
