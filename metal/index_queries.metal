// Index queries of fp32 projection products: products [B, S, H, D] (any float dtype, D a
// multiple of 32) -> out [B, S, H, D] bf16: v = bf16(products); the interleaved pairs of each
// head's last R channels turned by their row's angles (cosines, sines [T, R/2] fp32: T = S, the
// S rows' angles shared by every batch row (RoPE.cos_sin), or T = B * S, each batch row's own
// from its first position (rope_products.angles_of), row b * S + s) and rounded to bf16, as
// RoPE's ops do; then fp4_e8m0 quantise-dequantise per 32 channels: s = 2^ceil(log2(max(amax,
// 6 x 2^-126) x fp32(1/6))), E2M1(v / s) x s (nearest, ties to the even code), as
// quant.fp4_e8m0_qdq does. One thread per value (it turns its value by the angle of its token
// row b * S + s), one simdgroup per 32-value block (the threadgroup a multiple of 32 dividing
// the grid), so the block's amax is a simd_max; the quantisation is exact arithmetic.
uint i = thread_position_in_grid.x;
uint width = uint(products_shape[3]);
uint heads = uint(products_shape[2]);
uint table_rows = uint(cosines_shape[0]);
uint half_rope = uint(cosines_shape[1]);
uint token = i / (width * heads);  // b * S + s: its angles at table row s (T = S) or b * S + s
uint channel = i % width;
uint keep = width / 2 - half_rope;  // pairs before the rotated tail
float v = prep_bf16(float(products[i]));
if (channel / 2 >= keep) {
  uint angle = token % table_rows * half_rope + channel / 2 - keep;
  float other = prep_bf16(float(products[i ^ 1u]));
  v = prep_bf16(prep_rope_turn(v, other, cosines[angle], sines[angle], (channel & 1u) != 0u));
}
float amax = simd_max(fabs(v));
float t = max(amax, as_type<float>(V41_E8M0_FLOOR)) * as_type<float>(V41_ONE_SIXTH);
float s = v41_exp2i(v41_ceil_log2(t));
out[i] = bfloat16_t(V41_FP4_VALUES[v41_float_to_e2m1(v, s)] * s);
