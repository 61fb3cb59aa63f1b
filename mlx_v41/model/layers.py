"""Basic layers with the reference's rounding boundaries: RMSNorm and quantized linears.

`QuantLinear` keeps a checkpoint's FP8 (32x32 E8M0 blocks) or FP4 weight packed in MLX's
mxfp8/mxfp4 layout and, like the reference, FP8-rounds its input first (official
inference/model.py L181–207).
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import mlx.nn as nn

from ..kernels.act_fp8 import act_fp8
from ..numerics.norm import rms_norm, rms_norm_pair, to_fp32

# LM head weight dtypes: the reference's fp32, or bf16 (the checkpoint's values, half the bytes)
HEAD_DTYPES = ("float32", "bfloat16")


def head_logits(hidden: mx.array, weight: mx.array) -> mx.array:
    """fp32 logits of bf16 rows against the LM head `weight` [V, D]. fp32 weights: an fp32
    matmul (the reference). bf16 weights: a bf16 matmul (exact products, fp32 accumulation),
    so the logits carry its bf16 rounding (docs/correctness.md, "Deviations from the reference")."""
    if weight.dtype == mx.bfloat16:
        return (hidden.astype(mx.bfloat16) @ weight.T).astype(mx.float32)
    return hidden.astype(mx.float32) @ weight.T


class RMSNorm(nn.Module):
    """`bf16(w * (x * rsqrt(mean(x^2) + eps)))` with the normalisation in fp32."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,), dtype=mx.float32)  # bf16 values, promoted at load
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, self.weight, self.eps)

    def pair(self, x: mx.array):
        """(the norm in bf16, the same values in fp32) from one fused kernel, for a block
        whose readers take both."""
        return rms_norm_pair(x, self.weight, self.eps)

    def of_products(self, x: mx.array) -> mx.array:
        """The norm of bf16(x) for fp32 projection products x (`QuantLinear.matmul`): the
        output rounding runs inside the norm's fused kernels instead of as a kernel of its own."""
        return rms_norm(x, self.weight, self.eps, is_products=True)


def round_act_fp8(x: mx.array, dtype=None, is_products: bool = False) -> mx.array:
    """act_fp8 of x (`fp8_activation.act_fp8_qdq`), through its dispatcher."""
    return act_fp8(x, dtype, is_products)


class QuantLinear(nn.Module):
    """y = x W^T over a packed weight; `quantize_input` applies the reference's act_fp8."""

    pair = None  # paired.Pair: this linear and the next one as one matmul (made at load)

    def __init__(self, input_dims: int, output_dims: int, mode: str = "mxfp8", bits: int = 8,
                 group_size: int = 32, quantize_input: bool = True):
        super().__init__()
        allocate_quantized(self, (), output_dims, input_dims, mode, bits, group_size)
        self.quantize_input = quantize_input

    def __call__(self, x: mx.array) -> mx.array:
        return self.apply(self.prepare(x))

    def prepare(self, x: mx.array, is_products: bool = False) -> mx.array:
        """The matmul input: act_fp8-rounded (when the reference rounds it) fp32, shareable
        by linears that read the same activation. fp32 because MLX's CPU quantized matmul
        accumulates bf16 inputs in bf16; the FP8 values are exact in both. `is_products`: x
        is fp32 products whose bf16 rounding is the activation (rounded here, fused)."""
        if self.quantize_input:
            return round_act_fp8(x, mx.float32, is_products)
        return to_fp32(x, is_products)

    def apply(self, x: mx.array) -> mx.array:
        """y = x W^T for an input already `prepare`d; bf16 output."""
        return self.matmul(x).astype(mx.bfloat16)

    def matmul(self, x: mx.array) -> mx.array:
        """The fp32 products of `apply`, before the bf16 rounding of its output (for a consumer
        that rounds them inside its own fused kernel)."""
        return mx.quantized_matmul(
            x, self.weight, self.scales, self.get("biases"), transpose=True,
            group_size=self.group_size, bits=self.bits, mode=self.mode)


@functools.lru_cache(maxsize=64)
def batch_rows(shape: tuple) -> mx.array:
    """Evaluated uint32 row numbers over a batch shape: `gather_qmm`'s default `lhs_indices`
    (and an index dtype it does not cast), made once rather than at every call."""
    rows = mx.arange(math.prod(shape), dtype=mx.uint32).reshape(shape)
    mx.eval(rows)
    return rows


class Linear(nn.Module):
    """Unquantized linear; `fp32=True` computes in fp32 (ratio-2 compressor) with the weight
    held in fp32 (the checkpoint's bf16 values, promoted once at load)."""

    def __init__(self, input_dims: int, output_dims: int, fp32: bool = False):
        super().__init__()
        dtype = mx.float32 if fp32 else mx.bfloat16
        self.weight = mx.zeros((output_dims, input_dims), dtype=dtype)
        self.fp32 = fp32

    def __call__(self, x: mx.array) -> mx.array:
        if self.fp32:
            return x.astype(mx.float32) @ self.weight.T
        return x @ self.weight.T


# ---------------------------------------------------------------- quantized layouts

QUANT_MODES = ("affine", "mxfp4", "mxfp8", "nvfp4")  # mx.quantize modes


def allocate_quantized(module: nn.Module, lead: tuple, output_dims: int, input_dims: int,
                       mode: str, bits: int, group_size: int) -> None:
    """Zero packed parameters `weight [*lead, N, K*bits/32]` uint32 and `scales
    [*lead, N, K/group]` (uint8 for the mx/nv float modes; bf16 scales and biases for affine)."""
    if mode not in QUANT_MODES:
        raise ValueError(f"quantization mode {mode!r} is not one of {QUANT_MODES}")
    if input_dims % group_size or (input_dims * bits) % 32:
        raise ValueError(f"input width {input_dims} does not fit group size {group_size} at "
                         f"{bits} bits")
    module.weight = mx.zeros((*lead, output_dims, input_dims * bits // 32), dtype=mx.uint32)
    scale_dtype = mx.bfloat16 if mode == "affine" else mx.uint8
    module.scales = mx.zeros((*lead, output_dims, input_dims // group_size), dtype=scale_dtype)
    if mode == "affine":
        module.biases = mx.zeros_like(module.scales)
    elif "biases" in module:
        del module["biases"]
    module.mode, module.bits, module.group_size = mode, bits, group_size


def is_quantized(module: nn.Module) -> bool:
    """QuantLinear, SwitchLinear, GroupedLinear: packed weights with a mode/bits/group_size."""
    return getattr(module, "mode", None) in QUANT_MODES and "scales" in module


def input_dims(module: nn.Module) -> int:
    """Logical input width K of a quantized module."""
    return module.weight.shape[-1] * 32 // module.bits


def quantization_for(quantization: dict, path: str) -> dict:
    """The {group_size, bits, mode} that an mlx-lm `quantization` block gives module `path`:
    its per-path entry if any, else the top-level values (mode defaults to affine)."""
    entry = quantization.get(path)
    source = entry if isinstance(entry, dict) else quantization
    try:
        return {"group_size": int(source["group_size"]), "bits": int(source["bits"]),
                "mode": source.get("mode", "affine")}
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"quantization entry for {path} needs group_size and bits") from None


def configure_quantization(model: nn.Module, quantization: dict) -> None:
    """Lay out every quantized module of `model` as a `quantization` block says (zeroed
    parameters of the new shapes, to be loaded); modules already in that layout are kept."""
    for path, module in model.named_modules():
        if not is_quantized(module):
            continue
        q = quantization_for(quantization, path)
        if (q["mode"], q["bits"], q["group_size"]) != (module.mode, module.bits,
                                                        module.group_size):
            *lead, output_dims, _ = module.weight.shape
            allocate_quantized(module, tuple(lead), output_dims, input_dims(module),
                               q["mode"], q["bits"], q["group_size"])
