// The mHC mixes and Sinkhorn of one token (official inference/model.py L948-994) from each
// thread's partial sums, shared by mhc.metal (the copies read) and mhc_expand.metal (the copies
// made by the previous side's expand first). `acc` [M + 1]: this thread's share of the
// M = (2 + N) * N dot products with fn and, last, of the sum of squares; `partial`:
// threadgroup memory of (THREADS / 32) * (M + 1) floats. The simdgroups' sums meet in
// `partial`; then thread 0 scales the mixes by rsqrt(mean(x^2) + norm_eps) and runs the
// Sinkhorn normalisation in the order of the ops (row softmax, its row sum from 0, every other
// sum from eps; the last step normalises columns). Only the summation order of the N*D-long
// sums differs from the ops.
#include <metal_stdlib>
using namespace metal;

template <int N, int THREADS>
inline void v41_mhc_finish(thread float* acc, threadgroup float* partial, uint lane, uint sg,
                           uint tid, int width, int token, const device float* base,
                           const device float* scale, int iters, float eps, float norm_eps,
                           device float* pre, device float* post, device float* comb) {
  constexpr int M = (2 + N) * N;
  constexpr int SIMDGROUPS = THREADS / 32;
  for (int m = 0; m <= M; ++m) {
    float total = simd_sum(acc[m]);
    if (lane == 0) {
      partial[sg * (M + 1) + m] = total;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid != 0) {
    return;
  }
  float mix[M + 1];
  for (int m = 0; m <= M; ++m) {
    float total = 0.0f;
    for (int s = 0; s < SIMDGROUPS; ++s) {
      total += partial[s * (M + 1) + m];
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
