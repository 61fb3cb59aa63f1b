// MoE router selection of one token row per simdgroup, from the router's fp32 logits (MLX's
// matmul, run before this kernel on the whole GPU): logits [T, E] fp32, bias / bias_vl [E]
// fp32, mask [T] (read only when MASKED: rows that select with bias_vl), route_scale
// -> ids [T, K] uint32, weights [T, K] fp32.
//   score_e = sqrt(softplus(logit_e)), softplus linear above 20 (torch's threshold) and
//   otherwise MLX's Metal logaddexp(l, 0) = max(l, 0) + log1p(exp(-|l|)), with MLX's log1p;
//   the K experts with the largest score_e + bias_e (ties: the lower id), in that order;
//   weights = score / (sum of the K scores, in pick order, + 1e-20) * route_scale.
// Lane l holds experts l, l + 32, ... in registers; each pick is one simd_max over the lanes'
// best remaining keys, then a simd_min over the ids that hold it. The threadgroup is
// (32, rows per group): each y is one simdgroup and one row, and no memory is shared.
constexpr int PER_LANE = (E + 31) / 32;

uint lane = thread_index_in_simdgroup;
int row = int(thread_position_in_grid.y);
const device float* lr = logits + row * E;
bool vision = MASKED && bool(mask[row]);

float score[PER_LANE];
float key[PER_LANE];
uint taken = 0u;  // bit j: expert lane + 32 j is picked (or does not exist)
for (int j = 0; j < PER_LANE; ++j) {
  int e = int(lane) + 32 * j;
  score[j] = 0.0f;
  key[j] = 0.0f;
  if (e >= E) {
    taken |= 1u << j;
    continue;
  }
  float logit = lr[e];
  float softplus = logit;
  if (!(logit > 20.0f)) {
    float t = exp(-fabs(logit));  // exp(min - max) of logaddexp(logit, 0)
    float tp1 = 1.0f + t;
    float log1p_t = tp1 == 1.0f ? t : t * (log(tp1) / (tp1 - 1.0f));
    softplus = max(logit, 0.0f) + log1p_t;
  }
  score[j] = sqrt(softplus);
  key[j] = score[j] + (vision ? bias_vl[e] : bias[e]);
}

uint picks[K];
float picked[K];
float total = 0.0f;
for (int p = 0; p < K; ++p) {
  float best = -INFINITY;
  uint best_e = uint(E);
  for (int j = 0; j < PER_LANE; ++j) {
    bool free_j = (taken & (1u << j)) == 0u;
    if (free_j && (best_e == uint(E) || key[j] > best)) {
      best = key[j];
      best_e = lane + 32u * uint(j);
    }
  }
  float top = simd_max(best_e < uint(E) ? best : -INFINITY);
  uint pick = simd_min(best_e < uint(E) && best == top ? best_e : uint(E));
  pick = pick < uint(E) ? pick : simd_min(best_e);  // NaN keys: the lowest remaining id
  uint slot = min(pick / 32u, uint(PER_LANE - 1));   // pick < E: K <= E experts exist
  if (pick % 32u == lane) {
    taken |= 1u << slot;
  }
  float own = 0.0f;  // score[slot], read without a dynamic index (registers stay registers)
  for (int j = 0; j < PER_LANE; ++j) {
    own = uint(j) == slot ? score[j] : own;
  }
  picks[p] = pick;
  picked[p] = simd_shuffle(own, ushort(pick % 32u));
  total += picked[p];
}
if (lane == 0) {
  for (int p = 0; p < K; ++p) {
    ids[row * K + p] = picks[p];
    weights[row * K + p] = picked[p] / (total + 1e-20f) * route_scale;
  }
}
