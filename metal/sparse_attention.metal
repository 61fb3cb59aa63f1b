// Fused sparse attention with sinks over the sliding window (bf16 rows) and the selected packed
// FP4 rows of the compressed KV (fp4_e4m3, decoded on the fly; K = V), one pass, online softmax.
//
// Threadgroup = one query row (b, s) x HEADS_PER_GROUP heads; SIMDGROUPS simdgroups of 32 lanes;
// lane owns channels [lane * C, lane * C + C). The query's key list is window_size window entries
// (rows newest - window_size + 1 .. newest, chronological; rows < window_first[b] are empty:
// 0, or the front padding of a window still filling) then the `topk`
// entries of its `rows` (-1 or >= n_rows: empty). It is walked in blocks of 64 entries, each
// split over the simdgroups: (1) scores z = (q . k) * scale in fp32 into threadgroup memory;
// (2) after one barrier every simdgroup computes the same block max m_new = max(m, max z),
// rescales its (l, acc) by exp(m - m_new), adds the unrounded exp(z - m_new) to l, and
// accumulates bf16(exp(z - m_new)) * v over its own entries (the key row is read again,
// cache-hot). Probabilities are thus rounded to bf16 relative to the running max after each
// block of 64 entries, as in the reference kernel. Finally l += exp(sink - m), the simdgroups'
// acc are summed and out = bf16(acc / l).
constexpr int C = HEAD_DIM / 32;
constexpr int KEYS_PER_SIMDGROUP = 64 / SIMDGROUPS;
threadgroup float scores[2][HEADS_PER_GROUP][64];
threadgroup float partial[SIMDGROUPS][HEAD_DIM];

uint lane = thread_index_in_simdgroup;
uint sg = simdgroup_index_in_threadgroup;
int queries = q_shape[1];
int heads = q_shape[2];
int qrow = int(threadgroup_position_in_grid.y);  // b * S + s
int batch = qrow / queries;
int head0 = int(threadgroup_position_in_grid.x) * HEADS_PER_GROUP;
int window_rows = window_shape[1];
int newest = window_rows - queries + qrow % queries;  // the query's own window row
int first = window_first[batch];  // window rows before it are empty (a window still filling)
int entries = window_size + topk;
int ch0 = int(lane) * C;

float qv[HEADS_PER_GROUP][C];
float acc[HEADS_PER_GROUP][C];
float m[HEADS_PER_GROUP];
float l[HEADS_PER_GROUP];
for (int h = 0; h < HEADS_PER_GROUP; ++h) {
  for (int c = 0; c < C; ++c) {
    qv[h][c] = float(q[(qrow * heads + head0 + h) * HEAD_DIM + ch0 + c]);
    acc[h][c] = 0.0f;
  }
  m[h] = -1e30f;  // finite: a query with no keys yields 0, not NaN
  l[h] = 0.0f;
}

// Blocks before the first existing window row hold only empty entries: skipping them changes
// nothing (their scores are -inf), and block boundaries stay at multiples of 64 entries.
for (int blk = max(0, window_size - 1 - newest + first) / 64; blk < (entries + 63) / 64;
     ++blk) {
  int buf = blk & 1;
  for (int phase = 0; phase < 2; ++phase) {
    if (phase == 1) {
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (int h = 0; h < HEADS_PER_GROUP; ++h) {
        float z0 = scores[buf][h][lane];
        float z1 = scores[buf][h][lane + 32];
        float m_new = max(m[h], simd_max(max(z0, z1)));
        float alpha = exp(m[h] - m_new);
        l[h] = l[h] * alpha + simd_sum(exp(z0 - m_new) + exp(z1 - m_new));
        for (int c = 0; c < C; ++c) {
          acc[h][c] *= alpha;
        }
        m[h] = m_new;
      }
    }
    for (int k = 0; k < KEYS_PER_SIMDGROUP; ++k) {
      int slot = int(sg) * KEYS_PER_SIMDGROUP + k;
      int entry = blk * 64 + slot;
      bool from_window = entry < window_size;
      int src = -1;  // window row or packed row of this entry; -1 = empty
      if (from_window) {
        src = newest - window_size + 1 + entry;
        src = src < first ? -1 : src;
      } else if (entry < entries) {
        int r = rows[qrow * topk + entry - window_size];
        src = r < n_rows ? r : -1;
      }
      if (src < 0) {
        if (phase == 0 && lane == 0) {
          for (int h = 0; h < HEADS_PER_GROUP; ++h) {
            scores[buf][h][slot] = -INFINITY;
          }
        }
        continue;
      }
      float kv[C];
      if (from_window) {
        for (int c = 0; c < C; ++c) {
          kv[c] = float(window[(batch * window_rows + src) * HEAD_DIM + ch0 + c]);
        }
      } else {
        v41_decode_fp4_e4m3<C>(packed + (batch * packed_shape[1] + src) * packed_shape[2],
                               HEAD_DIM, ch0, kv);
      }
      for (int h = 0; h < HEADS_PER_GROUP; ++h) {
        if (phase == 0) {
          float score = 0.0f;
          for (int c = 0; c < C; ++c) {
            score += qv[h][c] * kv[c];
          }
          score = simd_sum(score) * scale;
          if (lane == 0) {
            scores[buf][h][slot] = score;
          }
        } else {
          float p = float(bfloat16_t(exp(scores[buf][h][slot] - m[h])));
          for (int c = 0; c < C; ++c) {
            acc[h][c] += p * kv[c];
          }
        }
      }
    }
  }
}

for (int h = 0; h < HEADS_PER_GROUP; ++h) {
  float denom = l[h] + exp(sinks[head0 + h] - m[h]);
  for (int c = 0; c < C; ++c) {
    partial[sg][ch0 + c] = acc[h][c];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int ch = int(thread_index_in_threadgroup); ch < HEAD_DIM; ch += SIMDGROUPS * 32) {
    float total = 0.0f;
    for (int g = 0; g < SIMDGROUPS; ++g) {
      total += partial[g][ch];
    }
    out[(qrow * heads + head0 + h) * HEAD_DIM + ch] = bfloat16_t(total / denom);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
