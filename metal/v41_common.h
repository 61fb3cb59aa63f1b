// Shared helpers for the mlx_v41 kernels: the E4M3FN / E2M1 / E8M0 codecs and the packed cache
// rows of mlx_v41.numerics.quant. Every rounding decision uses integer or exact
// fp32 arithmetic, so results are bit-identical to mlx_v41.quant whatever the GPU's division
// accuracy. Plain MSL; helpers take attribute values as arguments.
#include <metal_stdlib>
using namespace metal;

constant constexpr float V41_FP4_VALUES[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
constant constexpr uint V41_ONE_SIXTH = 0x3E2AAAABu;      // fp32(1/6), the reference's reciprocal
constant constexpr uint V41_ONE_448TH = 0x3B124925u;      // fp32(1/448)
constant constexpr uint V41_ACT_FP8_FLOOR = 0x38D1B717u;  // fp32(1e-4), act_fp8 amax floor
constant constexpr float V41_E4M3_FLOOR = 0.01171875f;    // 6 * 2^-9, fp4_e4m3 amax floor
constant constexpr uint V41_E8M0_FLOOR = 0x01C00000u;     // 6 * 2^-126, fp4_e8m0 amax floor

// 2^e for -126 <= e <= 127, exact.
inline float v41_exp2i(int e) {
  return as_type<float>(uint(e + 127) << 23);
}

// ceil(log2 t) for a positive normal fp32 t, from its bit pattern (never from log2()).
inline int v41_ceil_log2(float t) {
  uint bits = as_type<uint>(t);
  return int((bits >> 23) & 0xFFu) - 127 + ((bits & 0x7FFFFFu) != 0u ? 1 : 0);
}

// act_fp8 block exponent e (scale 2^e = 2^ceil(log2(max(amax, 1e-4) * fp32(1/448)))) of a
// block's largest magnitude, exact; -22 <= e <= 120 for finite amax.
inline int v41_act_fp8_exponent(float amax) {
  return v41_ceil_log2(max(amax, as_type<float>(V41_ACT_FP8_FLOOR)) * as_type<float>(V41_ONE_448TH));
}

// E4M3FN byte -> fp32 (0x7F / 0xFF -> NaN), exact.
inline float v41_e4m3_to_float(uint code) {
  uint e = (code >> 3) & 0xFu;
  uint m = code & 7u;
  float mag = e == 0u ? float(m) * 0.001953125f : as_type<float>(((e + 120u) << 23) | (m << 20));
  mag = (code & 0x7Fu) == 0x7Fu ? as_type<float>(0x7FC00000u) : mag;
  return (code & 0x80u) != 0u ? -mag : mag;
}

// fp32 -> E4M3FN byte: clamp |x| to 448, round to nearest even (saturating), sign kept, NaN -> 0x7F.
inline uint v41_float_to_e4m3(float x) {
  uint bits = as_type<uint>(x);
  uint sign = (bits >> 24) & 0x80u;
  uint a = bits & 0x7FFFFFFFu;
  if (a > 0x7F800000u) {
    return sign | 0x7Fu;
  }
  a = min(a, 0x43E00000u);  // 448
  if (a >= 0x3C800000u) {   // >= 2^-6: keep 3 mantissa bits, RNE; a carry moves the exponent
    return sign | (((a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20) - (120u << 3));
  }
  // Subnormal grid (step 2^-9): code = RNE(|x| * 2^9) = RNE(mant * 2^(E - 141)), shift >= 21.
  uint exponent = a >> 23;
  uint shift = 141u - exponent;
  if (exponent == 0u || shift > 24u) {
    return sign;  // below 2^-10: rounds to zero
  }
  uint mant = (a & 0x7FFFFFu) | 0x800000u;
  uint q = mant >> shift;
  uint rest = mant & ((1u << shift) - 1u);
  uint half_step = 1u << (shift - 1u);
  q += (rest > half_step || (rest == half_step && (q & 1u) != 0u)) ? 1u : 0u;
  return sign | q;
}

// E2M1 code of clamp(x / s, -6, 6) for a scale s > 0: nearest grid value, ties to the even code,
// sign kept (-0 is code 8). The products t * s are exact (t has <= 3 significant bits, s is
// an E4M3 value or a power of two), and `x >= t*s` decides exactly as `RN(x / s) >= t` for every
// such scale (checked over all 126 E4M3 scales), so no division is needed.
inline uint v41_float_to_e2m1(float x, float s) {
  float a = fabs(x);
  uint m = (a > 0.25f * s ? 1u : 0u) + (a >= 0.75f * s ? 1u : 0u) + (a > 1.25f * s ? 1u : 0u) +
           (a >= 1.75f * s ? 1u : 0u) + (a > 2.5f * s ? 1u : 0u) + (a >= 3.5f * s ? 1u : 0u) +
           (a > 5.0f * s ? 1u : 0u);
  return m | ((as_type<uint>(x) >> 28) & 8u);
}

// E4M3 code of amax / 6 (fp32 division, then RNE) without a division.
// fp32(1/6) > 1/6, so the guess E4M3(amax * fp32(1/6)) is never below the answer and, being within
// 2^-22 of it, at most one code above; the decision point below the guess, 6 x (midpoint of two
// E4M3 values), is an exact fp32 product, so comparing amax with it settles the code exactly.
inline uint v41_e4m3_scale_code(float amax) {
  uint c = v41_float_to_e4m3(amax * as_type<float>(V41_ONE_SIXTH));
  if (c > 0u) {
    float down = 3.0f * (v41_e4m3_to_float(c - 1u) + v41_e4m3_to_float(c));
    c -= (amax < down || (amax == down && (c & 1u) != 0u)) ? 1u : 0u;
  }
  return c;
}

// Decode channels [ch0, ch0 + N) of a packed fp4_e4m3 row of `width` channels:
// width/2 code bytes, element 2b in the low nibble, then one E4M3 scale byte per 16 channels).
template <int N, typename BytePtr>
inline void v41_decode_fp4_e4m3(BytePtr row, int width, int ch0, thread float* out) {
  float scale = 0.0f;
  for (int c = 0; c < N; ++c) {
    int ch = ch0 + c;
    if (c == 0 || (ch & 15) == 0) {
      scale = v41_e4m3_to_float(uint(row[width / 2 + ch / 16]));
    }
    uint byte = uint(row[ch >> 1]);
    out[c] = V41_FP4_VALUES[(ch & 1) != 0 ? (byte >> 4) : (byte & 15u)] * scale;
  }
}
