// act_fp8 quantise-dequantise: x [n] (any float dtype, n a multiple of 32) -> out [n] of T,
// E4M3(v / s) * s per block of 32 consecutive values, s = 2^e a power of two (v41_common.h).
// P (products): v = bf16(x), the activation of fp32 projection products; otherwise v = x.
// One thread per value, one simdgroup per block (the threadgroup is a multiple of 32 dividing
// n), so the block's amax is a simd_max. v / s is the product with the exact 2^-e, and every
// other step is exact too, so the values equal the MLX ops' bit for bit.
uint i = thread_position_in_grid.x;
float v = P ? float(bfloat16_t(float(x[i]))) : float(x[i]);
int e = v41_act_fp8_exponent(simd_max(fabs(v)));
out[i] = T(v41_e4m3_to_float(v41_float_to_e4m3(v * v41_exp2i(-e))) * v41_exp2i(e));
