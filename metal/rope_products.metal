// Query RoPE of fp32 projection products: products [B, S, H, D] (any float dtype) -> out
// [B, S, H, D] bf16: v = bf16(products), then the interleaved pairs of each head's last R
// channels turned by the angles of their row (cosines, sines [S, R/2] fp32: RoPE.cos_sin), the
// turned values rounded to bf16; the first D - R channels pass through as v. The same fp32
// products and sums as RoPE's ops. One thread per pair (D even).
uint pair = thread_position_in_grid.x;
uint pairs = uint(products_shape[3]) / 2;
uint heads = uint(products_shape[2]);
uint length = uint(products_shape[1]);
uint half_rope = uint(cosines_shape[1]);
uint p = pair % pairs;
uint keep = pairs - half_rope;  // pairs before the rotated tail
float re = prep_bf16(float(products[2 * pair]));
float im = prep_bf16(float(products[2 * pair + 1]));
if (p >= keep) {
  uint angle = (pair / (pairs * heads)) % length * half_rope + p - keep;
  float c = cosines[angle];
  float s = sines[angle];
  float turned_re = prep_rope_turn(re, im, c, s, false);
  im = prep_rope_turn(im, re, c, s, true);
  re = turned_re;
}
out[2 * pair] = bfloat16_t(re);
out[2 * pair + 1] = bfloat16_t(im);
