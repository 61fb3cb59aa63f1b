// Window rows of one attention call: out [B, K, D] bf16 = per batch row b, the concatenation (the
// ring's decoded rows of positions p - count .. p - 1, then the call's new rows [B, S, D]) from
// its row `skip` on (K = count + S - skip); p = positions[b], positions [B] int32 the position
// of batch row b's rows[b, 0] (the same value in every entry for one shared position). Ring
// rows of positions before 0 (a row whose window is still filling) come out as zeros.
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
int held = positions[batch] - int(older) + int(row);  // position of ring row `row`
if (row < older && held < 0) {
  out[tid] = bfloat16_t(0.0f);  // before position 0 (a window still filling): a zero row
} else if (row < older) {
  uint slot = uint(held) % slots;
  uint src = (batch * slots + slot) * row_bytes;
  float scale = prep_e8m0_to_float(uint(ring[src + width + channel / 32]));
  out[tid] = bfloat16_t(v41_e4m3_to_float(uint(ring[src + channel])) * scale);
} else {
  out[tid] = rows[(batch * fresh + row - older) * width + channel];
}
