// Query RoPE of fp32 projection products: products [B, S, H, D] (any float dtype) -> out
// [B, S, H, D] bf16: v = bf16(products), then the interleaved pairs of each head's last R
// channels turned by the angles of their row (cosines, sines [T, R/2] fp32: T = S, the S rows'
// angles shared by every batch row (RoPE.cos_sin), or T = B * S, each batch row's own from its
// first position (rope_products.angles_of), row b * S + s), the turned values rounded to bf16;
// the first D - R channels pass through as v. The same fp32 products and sums as RoPE's ops.
// One thread per pair (D even): it rounds its pair and turns it by the angle of its token row
// b * S + s, read from table row s (T = S) or b * S + s (T = B * S).
uint pair = thread_position_in_grid.x;
uint pairs = uint(products_shape[3]) / 2;
uint heads = uint(products_shape[2]);
uint table_rows = uint(cosines_shape[0]);
uint half_rope = uint(cosines_shape[1]);
uint token = pair / (pairs * heads);  // b * S + s
uint p = pair % pairs;
uint keep = pairs - half_rope;  // pairs before the rotated tail
float re = prep_bf16(float(products[2 * pair]));
float im = prep_bf16(float(products[2 * pair + 1]));
if (p >= keep) {
  uint angle = token % table_rows * half_rope + p - keep;
  float c = cosines[angle];
  float s = sines[angle];
  float turned_re = prep_rope_turn(re, im, c, s, false);
  im = prep_rope_turn(im, re, c, s, true);
  re = turned_re;
}
out[2 * pair] = bfloat16_t(re);
out[2 * pair + 1] = bfloat16_t(im);
