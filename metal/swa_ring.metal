// Sliding-window ring update: out = ring with the act_fp8-rounded rows [B, S, D] written at slots
// (positions[b] + i) % R, positions [B] int32 the first position of batch row b's rows (the same
// value in every entry for one shared offset); only the last min(S, R) rows land (an earlier
// row's slot is overwritten by a later one). Two ring formats (template PACKED):
//   false: ring [B, R, D] of T values, a kept row becomes its QDQ value E4M3(x / s) * s;
//   true:  ring [B, R, D + D/32] uint8 rows: D E4M3 codes, then D/32 E8M0 bytes.
// One thread per (row, channel); D % 32 == 0, so a simdgroup covers exactly one 32-channel
// act_fp8 group of one ring row and every branch below is uniform per simdgroup.
uint tid = thread_position_in_grid.x;
uint width = uint(rows_shape[2]);
uint slots = uint(ring_shape[1]);
uint row_bytes = uint(ring_shape[2]);
uint count = uint(rows_shape[1]);
uint batch = tid / (slots * width);
uint slot = (tid / width) % slots;
uint channel = tid % width;
uint dst = (batch * slots + slot) * row_bytes;
bool writes_scale = PACKED && channel % 32 == 0;
uint offset = uint(positions[batch]);  // this batch row's position of rows[batch, 0]
uint first = count - min(count, slots);  // first row that survives
// The surviving row i in [first, count) with (offset + i) % R == slot, if any.
uint i = first + (slot + slots - (offset + first) % slots) % slots;
if (i < count) {
  float v = float(rows[(batch * count + i) * width + channel]);
  int e = v41_act_fp8_exponent(simd_max(fabs(v)));
  uint code = v41_float_to_e4m3(v * v41_exp2i(-e));  // x / 2^e, exact
  if (PACKED) {
    out[dst + channel] = T(float(code));
  } else {
    out[dst + channel] = T(v41_e4m3_to_float(code) * v41_exp2i(e));  // exact QDQ value
  }
  if (writes_scale) {
    out[dst + width + channel / 32] = T(float(e + 127));
  }
} else {
  out[dst + channel] = ring[dst + channel];
  if (writes_scale) {
    out[dst + width + channel / 32] = ring[dst + width + channel / 32];
  }
}
