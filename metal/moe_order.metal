// The routed experts' (token, expert) pairs in expert order, for gather_qmm's sorted path:
// ids [P] uint32 (pair t*K + j is token t's j-th expert), weights [P] float, x [T, D] ->
// rows [P, D] (each pair's token row, pairs in expert order), sorted_ids [P], sorted_weights
// [P], place [P] (each pair's place in that order: the inverse permutation). The order is the
// stable one (equal experts keep pair order), MLX's argsort's. One threadgroup per pair (a
// multiple of 32 threads): its threads count the pairs that go before it, then copy its row.
threadgroup uint counts[32];  // one per simdgroup
uint pair = threadgroup_position_in_grid.x;
uint t = thread_position_in_threadgroup.x;
uint n = threads_per_threadgroup.x;
uint pairs = uint(ids_shape[0]);
uint width = uint(x_shape[1]);
uint mine = ids[pair];
uint before = 0;
for (uint q = t; q < pairs; q += n) {
  uint other = ids[q];
  before += (other < mine || (other == mine && q < pair)) ? 1u : 0u;
}
before = simd_sum(before);
if (thread_index_in_simdgroup == 0) {
  counts[simdgroup_index_in_threadgroup] = before;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
uint at = 0;
for (uint g = 0; g < n / 32; ++g) {
  at += counts[g];
}
uint src = (pair / uint(K)) * width;
for (uint d = t; d < width; d += n) {
  rows[at * width + d] = x[src + d];
}
if (t == 0) {
  sorted_ids[at] = mine;
  sorted_weights[at] = weights[pair];
  place[pair] = at;
}
