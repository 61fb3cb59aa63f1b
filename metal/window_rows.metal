// Window rows of one attention call: out [B, K, D] bf16 = rows [count, count + S) of the
// concatenation (the ring's decoded rows of positions position - count .. position - 1, then the
// call's new rows [B, S, D]), from its row `skip` on (K = count + S - skip).
// ring [B, R, D + D/32] uint8 is the packed window ring (slot = position mod R): per row D E4M3
// codes, then D/32 E8M0 scale bytes (swa_ring.metal writes it). Decoding is E4M3 x 2^(b - 127)
// in fp32, then bf16: exact, so the values equal the ops' (take, unpack, concatenate, slice).
// One thread per output value.
uint tid = thread_position_in_grid.x;
uint width = uint(rows_shape[2]);
uint fresh = uint(rows_shape[1]);
uint slots = uint(ring_shape[1]);
uint row_bytes = uint(ring_shape[2]);
uint older = uint(count);
uint kept = older + fresh - uint(skip);
uint batch = tid / (kept * width);
uint row = (tid / width) % kept + uint(skip);  // row of the concatenation
uint channel = tid % width;
if (row < older) {
  uint slot = (uint(position) - older + row) % slots;
  uint src = (batch * slots + slot) * row_bytes;
  float scale = prep_e8m0_to_float(uint(ring[src + width + channel / 32]));
  out[tid] = bfloat16_t(v41_e4m3_to_float(uint(ring[src + channel])) * scale);
} else {
  out[tid] = rows[(batch * fresh + row - older) * width + channel];
}
