// mHC mixes and Sinkhorn of one block side (official inference/model.py L948-994):
// streams [T, N, D] (the N residual copies of T tokens) -> pre [T, N], post [T, N],
// comb [T, N, N] fp32. One threadgroup of THREADS threads per token. Each thread sums its
// share of the N*D channels: x^2 and the M = (2 + N) * N dot products with fn [M, N*D]; then
// v41_mhc_finish (mhc.h) meets the sums and runs the mixes and the Sinkhorn.
constexpr int M = (2 + N) * N;
threadgroup float partial[(THREADS / 32) * (M + 1)];

uint tid = thread_position_in_threadgroup.x;
int token = int(threadgroup_position_in_grid.y);
int width = streams_shape[1] * streams_shape[2];  // N * D
const device bfloat16_t* x = streams + token * width;

float acc[M + 1];
for (int m = 0; m <= M; ++m) {
  acc[m] = 0.0f;
}
for (int k = int(tid); k < width; k += THREADS) {
  float v = float(x[k]);
  acc[M] += v * v;
  for (int m = 0; m < M; ++m) {
    acc[m] += v * fn[m * width + k];
  }
}
v41_mhc_finish<N, THREADS>(acc, partial, thread_index_in_simdgroup,
                           simdgroup_index_in_threadgroup, tid, width, token, base, scale, iters,
                           eps, norm_eps, pre, post, comb);
