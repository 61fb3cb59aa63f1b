// The previous side's expand, then this side's mHC mixes and Sinkhorn, in one launch:
// y [T, D] (the block output: fp32 products whose bf16 rounding it is, or bf16),
// residual [T, N, D] bf16 (the copies before the block), hc_post [T, N] and hc_comb [T, N, N]
// (that block's mixes) -> streams [T, N, D] bf16, copy b = bf16(post_b * bf16(y) +
// sum_a comb[a, b] * residual_a) as `mhc.expand` computes it (the sum over a in order from 0),
// and this side's pre, post, comb (mhc.metal, from the copies just made, as each thread holds
// them). One threadgroup of THREADS threads per token.
constexpr int M = (2 + N) * N;
threadgroup float partial[(THREADS / 32) * (M + 1)];

uint tid = thread_position_in_threadgroup.x;
int token = int(threadgroup_position_in_grid.y);
int dim = residual_shape[2];
int width = N * dim;
const device bfloat16_t* r = residual + token * width;

float acc[M + 1];
for (int m = 0; m <= M; ++m) {
  acc[m] = 0.0f;
}
for (int k = int(tid); k < width; k += THREADS) {
  int b = k / dim;
  int d = k - b * dim;
  float mixed = 0.0f;
  for (int a = 0; a < N; ++a) {
    mixed = mixed + hc_comb[(token * N + a) * N + b] * float(r[a * dim + d]);
  }
  float yv = float(bfloat16_t(float(y[token * dim + d])));
  bfloat16_t out = bfloat16_t(hc_post[token * N + b] * yv + mixed);
  streams[token * width + k] = out;
  float v = float(out);
  acc[M] += v * v;
  for (int m = 0; m < M; ++m) {
    acc[m] += v * fn[m * width + k];
  }
}
v41_mhc_finish<N, THREADS>(acc, partial, thread_index_in_simdgroup,
                           simdgroup_index_in_threadgroup, tid, width, token, base, scale, iters,
                           eps, norm_eps, pre, post, comb);
