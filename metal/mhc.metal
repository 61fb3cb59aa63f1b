// mHC mixes and Sinkhorn of one block side (official inference/model.py L948-994):
// streams [T, N, D] (the N residual copies of T tokens) -> pre [T, N], post [T, N],
// comb [T, N, N] fp32. One threadgroup of THREADS threads per token. Each thread sums its
// share of the N*D channels: x^2 and the M = (2 + N) * N dot products with fn [M, N*D]; the
// simdgroups' sums meet in threadgroup memory. Then lane 0 scales the mixes by
// rsqrt(mean(x^2) + norm_eps) and runs the Sinkhorn normalisation in the order of the ops
// (row softmax, its row sum from 0, every other sum from eps; the last step normalises
// columns). Only the summation order of the N*D-long sums differs from the ops.
constexpr int M = (2 + N) * N;
constexpr int SIMDGROUPS = THREADS / 32;
threadgroup float partial[SIMDGROUPS][M + 1];

uint lane = thread_index_in_simdgroup;
uint sg = simdgroup_index_in_threadgroup;
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
for (int m = 0; m <= M; ++m) {
  float total = simd_sum(acc[m]);
  if (lane == 0) {
    partial[sg][m] = total;
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (tid == 0) {
  float mix[M + 1];
  for (int m = 0; m <= M; ++m) {
    float total = 0.0f;
    for (int s = 0; s < SIMDGROUPS; ++s) {
      total += partial[s][m];
    }
    mix[m] = total;
  }
  float rms = rsqrt(mix[M] / float(width) + norm_eps);
  for (int i = 0; i < N; ++i) {
    float p = mix[i] * rms * scale[0] + base[i];
    pre[token * N + i] = 1.0f / (1.0f + exp(-p)) + eps;
    float q = mix[N + i] * rms * scale[1] + base[N + i];
    post[token * N + i] = 2.0f * (1.0f / (1.0f + exp(-q)));
  }
  float c[N][N];
  for (int a = 0; a < N; ++a) {
    float peak = -INFINITY;
    for (int b = 0; b < N; ++b) {
      c[a][b] = mix[2 * N + a * N + b] * rms * scale[2] + base[2 * N + a * N + b];
      peak = max(peak, c[a][b]);
    }
    float sum = 0.0f;
    for (int b = 0; b < N; ++b) {
      c[a][b] = exp(c[a][b] - peak);
      sum = b == 0 ? c[a][b] : sum + c[a][b];
    }
    for (int b = 0; b < N; ++b) {
      c[a][b] = c[a][b] / sum + eps;
    }
  }
  for (int it = 0; it < iters; ++it) {
    if (it > 0) {
      for (int a = 0; a < N; ++a) {
        float sum = eps;
        for (int b = 0; b < N; ++b) {
          sum += c[a][b];
        }
        for (int b = 0; b < N; ++b) {
          c[a][b] = c[a][b] / sum;
        }
      }
    }
    for (int b = 0; b < N; ++b) {
      float sum = eps;
      for (int a = 0; a < N; ++a) {
        sum += c[a][b];
      }
      for (int a = 0; a < N; ++a) {
        c[a][b] = c[a][b] / sum;
      }
    }
  }
  for (int a = 0; a < N; ++a) {
    for (int b = 0; b < N; ++b) {
      comb[(token * N + a) * N + b] = c[a][b];
    }
  }
}
