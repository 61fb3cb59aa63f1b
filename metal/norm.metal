// The RMSNorm family of a decoder layer in one launch: [mHC collapse ->] RMSNorm [-> RoPE]
// [-> act_fp8], one threadgroup of THREADS threads per token row (kernels/norm.py).
// Input: N > 0: x [T, N, D] bf16 copies, collapsed with pre [T, N] fp32 as mhc.collapse does
// (((0 + p0 s0) + p1 s1) + ..., rounded to bf16); N == 0: x [T, D] rows, with P (products)
// the bf16 rounding of fp32 projection products. Norm: bf16(weight * (v * rsqrt(mean(v^2) +
// eps))), the sum of squares in the order of layers._pairwise_mean (halves added while the
// width is even and above LEAF (its PAIRWISE_LEAF), then the remaining partial sums in
// sequence): thread t holds channels t + k * THREADS, so the first halvings pair its own
// registers, the next run in threadgroup memory. R > 0: RoPE (rope.RoPE, interleaved pairs)
// on the last R channels, rounded to bf16, with rope_cos / rope_sin [T, R / 2] of table row
// row % T: T = S, the S rows' angles shared by every batch row (row b * S + s reads row s), or
// T = B * S, each batch row's own from its first position (rope_products.angles_of: row
// b * S + s reads row b * S + s).
// Outputs, each written when its flag is set (else a one-element buffer, zeroed): y (WY)
// bf16, y32 (WY32) its fp32 copy, q8 (WQ) its act_fp8 quantise-dequantise in Q, per 32
// channels: one simdgroup holds one block of 32 channels in each register, so its amax is a
// simd_max (exact, v41_common.h).
constexpr int PER = D / THREADS;  // registers per thread, a power of two
threadgroup float tree[THREADS];

uint tid = thread_position_in_threadgroup.x;
int row = int(threadgroup_position_in_grid.y);

float v[PER];
for (int k = 0; k < PER; ++k) {
  int c = int(tid) + k * THREADS;
  if (N > 0) {
    float acc = 0.0f;
    for (int i = 0; i < N; ++i) {
      float term = pre[row * N + i] * float(x[(row * N + i) * D + c]);
      acc = acc + term;
    }
    v[k] = float(bfloat16_t(acc));
  } else {
    v[k] = P ? float(bfloat16_t(float(x[row * D + c]))) : float(x[row * D + c]);
  }
}

// Sum of squares: register halvings (channel c + width / 2 sits in this thread's register
// k + h), then the threadgroup's, then the leaf's partial sums in sequence by every thread.
float sq[PER];
for (int k = 0; k < PER; ++k) {
  sq[k] = v[k] * v[k];
}
for (int h = PER / 2; h > 0; h /= 2) {
  for (int k = 0; k < h; ++k) {
    sq[k] = sq[k] + sq[k + h];
  }
}
tree[tid] = sq[0];
threadgroup_barrier(mem_flags::mem_threadgroup);
int width = THREADS;
for (; width % 2 == 0 && width > LEAF; width /= 2) {
  if (int(tid) < width / 2) {
    tree[tid] = tree[tid] + tree[tid + width / 2];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
float total = 0.0f;
for (int j = 0; j < width; ++j) {
  total = total + tree[j];
}
float inverse_rms = rsqrt(total / float(D) + eps);

float result[PER];
for (int k = 0; k < PER; ++k) {
  int c = int(tid) + k * THREADS;
  result[k] = float(bfloat16_t(weight[c] * (v[k] * inverse_rms)));
}

if (R > 0) {
  // Pair (re, im) = channels (2i, 2i + 1): lanes of one simdgroup (THREADS is a multiple of 32).
  // Each thread turns its channels by the angles of this token row's table row (T = S: its
  // position in the shared rows; T = B * S: its own batch row's).
  int crow = row % int(rope_cos_shape[0]);
  for (int k = 0; k < PER; ++k) {
    int c = int(tid) + k * THREADS;
    float partner = simd_shuffle_xor(result[k], ushort(1));
    if (c >= D - R) {
      int pair = crow * (R / 2) + (c - (D - R)) / 2;
      float cs = rope_cos[pair];
      float sn = (c & 1) == 0 ? -rope_sin[pair] : rope_sin[pair];
      float turned = result[k] * cs + partner * sn;
      result[k] = float(bfloat16_t(turned));
    }
  }
}

for (int k = 0; k < PER; ++k) {
  int i = row * D + int(tid) + k * THREADS;
  if (WY) {
    y[i] = bfloat16_t(result[k]);
  }
  if (WY32) {
    y32[i] = result[k];
  }
  if (WQ) {
    int e = v41_act_fp8_exponent(simd_max(fabs(result[k])));
    q8[i] = Q(v41_e4m3_to_float(v41_float_to_e4m3(result[k] * v41_exp2i(-e))) * v41_exp2i(e));
  }
}
if (row == 0 && tid == 0) {
  if (!WY) {
    y[0] = bfloat16_t(0.0f);
  }
  if (!WY32) {
    y32[0] = 0.0f;
  }
  if (!WQ) {
    q8[0] = Q(0.0f);
  }
}
