// Clamped SwiGLU of projection products, then act_fp8 (the down projection's input): gate, up
// [n] fp32 products (n a multiple of 32, rows of I values) -> out [n] fp32,
//   a = bf16(silu(min(bf16(g), limit)) * clip(bf16(u), -limit, limit) [* weight[row]])
//   out = E4M3(a / s) * s per block of 32 values, s = 2^e from the block's amax (v41_common.h).
// W: one routed weight per row of I values (the routed experts); otherwise `weight` is not read.
// One thread per value, one simdgroup per block (I is a multiple of 32, so a block never spans
// two rows), as in act_fp8.metal. The sigmoid is MLX's Metal one (1 / (1 + exp|x|), mirrored
// for x >= 0); every step after it is exact, so only exp's last bit can differ from the ops.
uint i = thread_position_in_grid.x;
float g = min(float(bfloat16_t(gate[i])), limit);
float u = min(max(float(bfloat16_t(up[i])), -limit), limit);
float y = 1.0f / (1.0f + metal::precise::exp(metal::abs(g)));
float act = g * (g < 0.0f ? y : 1.0f - y) * u;
if (W) {
  act = act * float(weight[i / I]);
}
float v = float(bfloat16_t(act));
int e = v41_act_fp8_exponent(simd_max(fabs(v)));
out[i] = v41_e4m3_to_float(v41_float_to_e4m3(v * v41_exp2i(-e))) * v41_exp2i(e);
