// FP4 cache-row packing: x [rows, width] (any float dtype) -> out [rows, width/2 +
// width/G] uint8. One thread per scale group of G channels: G/2 code bytes, then its scale byte.
// Template: G = 16 with E4M3 = true (fp4_e4m3, main KV) or G = 32 with E4M3 = false (fp4_e8m0,
// index keys). Inputs are finite by construction (NaN handling is not specified).
uint gid = thread_position_in_grid.x;
uint width = uint(x_shape[1]);
uint groups = width / uint(G);
if (gid < uint(x_shape[0]) * groups) {
  uint row = gid / groups;
  uint group = gid % groups;
  uint src = row * width + group * uint(G);
  float v[G];
  float amax = 0.0f;
  for (int i = 0; i < G; ++i) {
    v[i] = float(x[src + i]);
    amax = max(amax, fabs(v[i]));
  }
  uint scale_byte;
  float s;
  if (E4M3) {
    scale_byte = v41_e4m3_scale_code(max(amax, V41_E4M3_FLOOR));
    s = v41_e4m3_to_float(scale_byte);
  } else {
    float t = max(amax, as_type<float>(V41_E8M0_FLOOR)) * as_type<float>(V41_ONE_SIXTH);
    int e = v41_ceil_log2(t);
    scale_byte = uint(e + 127);
    s = v41_exp2i(e);
  }
  device uint8_t* dst = out + row * (width / 2 + groups);
  for (int i = 0; i < G; i += 2) {
    dst[group * uint(G / 2) + uint(i / 2)] =
        uint8_t(v41_float_to_e2m1(v[i], s) | (v41_float_to_e2m1(v[i + 1], s) << 4));
  }
  dst[width / 2 + group] = uint8_t(scale_byte);
}
