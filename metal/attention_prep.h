// Helpers of the attention-prep kernels (window_rows, rope_products, index_queries): the E8M0
// scale decode of the packed window ring and the RoPE turn of one channel, each the exact fp32
// arithmetic of the MLX ops (mlx_v41.numerics.quant, mlx_v41.numerics.rope). Plain MSL; included
// after v41_common.h.

// E8M0 byte b -> 2^(b - 127) as quant.e8m0_to_float decodes it (b = 0: 2^-127; b = 255: NaN).
inline float prep_e8m0_to_float(uint b) {
  uint bits = b == 0u ? 0x400000u : (b == 255u ? 0x7FC00000u : b << 23);
  return as_type<float>(bits);
}

// One channel of an interleaved RoPE pair (re, im) turned by (c, s): re c + im (-s) for the even
// channel, im c + re s for the odd one: the two fp32 products and the sum RoPE's ops make
// (`own` is this channel's value, `other` its pair partner's).
inline float prep_rope_turn(float own, float other, float c, float s, bool is_odd) {
  return own * c + other * (is_odd ? s : -s);
}

// The bf16 rounding of an fp32 value, as an fp32 (the activation of fp32 projection products).
inline float prep_bf16(float x) {
  return float(bfloat16_t(x));
}
