// out[row] = scale * sum(x[row, :]); one threadgroup of TG threads per row.
// Inputs: x [rows, n] (any float dtype T), scale (scalar float). TG: template, multiple of 32.
uint tid = thread_index_in_threadgroup;
uint row = threadgroup_position_in_grid.y;
uint n = x_shape[1];
threadgroup float partial[TG / 32];
float acc = 0.0f;
for (uint j = tid; j < n; j += TG) {
  acc += example_load(x, row * n + j);
}
acc = simd_sum(acc);
if (thread_index_in_simdgroup == 0) {
  partial[simdgroup_index_in_threadgroup] = acc;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (simdgroup_index_in_threadgroup == 0) {
  float v = thread_index_in_simdgroup < TG / 32 ? partial[thread_index_in_simdgroup] : 0.0f;
  v = simd_sum(v);
  if (tid == 0) {
    out[row] = T(v * scale);
  }
}
