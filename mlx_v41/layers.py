"""Basic layers with the reference's rounding boundaries: RMSNorm and quantized linears.

`QuantLinear` keeps a checkpoint's FP8 (32x32 E8M0 blocks) or FP4 weight packed in MLX's
mxfp8/mxfp4 layout and, like the reference, FP8-rounds its input first (spec numerics.md §1, Q1).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .quant import act_fp8_qdq


class RMSNorm(nn.Module):
    """`bf16(w * (x * rsqrt(mean(x^2) + eps)))` with the normalisation in fp32."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,), dtype=mx.bfloat16)
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        xf = x.astype(mx.float32)
        normed = xf * mx.rsqrt(mx.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (self.weight.astype(mx.float32) * normed).astype(mx.bfloat16)


class QuantLinear(nn.Module):
    """y = x W^T over a packed weight; `quantize_input` applies the reference's act_fp8."""

    def __init__(self, input_dims: int, output_dims: int, mode: str = "mxfp8", bits: int = 8,
                 group_size: int = 32, quantize_input: bool = True):
        super().__init__()
        self.weight = mx.zeros((output_dims, input_dims * bits // 32), dtype=mx.uint32)
        self.scales = mx.zeros((output_dims, input_dims // group_size), dtype=mx.uint8)
        if mode == "affine":
            self.scales = self.scales.astype(mx.bfloat16)
            self.biases = mx.zeros_like(self.scales)
        self.mode, self.bits, self.group_size = mode, bits, group_size
        self.quantize_input = quantize_input

    def __call__(self, x: mx.array) -> mx.array:
        if self.quantize_input:
            x = act_fp8_qdq(x)
        # fp32 input: MLX's CPU quantized matmul accumulates bf16 inputs in bf16.
        out = mx.quantized_matmul(
            x.astype(mx.float32), self.weight, self.scales, self.get("biases"), transpose=True,
            group_size=self.group_size, bits=self.bits, mode=self.mode)
        return out.astype(mx.bfloat16)


class Linear(nn.Module):
    """Unquantized linear; `fp32=True` promotes input and weight (router, ratio-2 compressor)."""

    def __init__(self, input_dims: int, output_dims: int, fp32: bool = False):
        super().__init__()
        self.weight = mx.zeros((output_dims, input_dims), dtype=mx.bfloat16)
        self.fp32 = fp32

    def __call__(self, x: mx.array) -> mx.array:
        if self.fp32:
            return x.astype(mx.float32) @ self.weight.astype(mx.float32).T
        return x @ self.weight.T
