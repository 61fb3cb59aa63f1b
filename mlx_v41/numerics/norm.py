"""RMSNorm with the reference's rounding: the normalisation in fp32, the mean of squares summed
pairwise (official inference/model.py `RMSNorm`; the order matters, see `_pairwise_mean`), the
result in bf16. `is_products`: fp32 projection products whose bf16 rounding runs inside the
norm's fused kernel.
"""

from __future__ import annotations

import functools

import mlx.core as mx

PAIRWISE_LEAF = 16  # values summed in sequence at the leaves of the pairwise norm reduction
LEVELS_FUSED = 4  # pairwise halvings per fused kernel: 16 chunk inputs (MLX fuses <= 24 arrays)


def rms_norm(x: mx.array, weight: mx.array, eps: float, is_products: bool = False) -> mx.array:
    """`RMSNorm` with its weight given (compiled per eps); `is_products` as in `of_products`."""
    return _compiled_rms_norm(eps, is_products)(x, weight)


def rms_norm_pair(x: mx.array, weight: mx.array, eps: float):
    """`RMSNorm.pair` with its weight given: (bf16 norm, its fp32 copy)."""
    return _compiled_rms_norm_pair(eps)(x, weight)


def _rms_norm(x: mx.array, weight: mx.array, eps: float, is_products: bool) -> mx.array:
    xf = to_fp32(x, is_products)
    normed = xf * mx.rsqrt(_pairwise_mean(x, is_products) + eps)
    return (weight * normed).astype(mx.bfloat16)


def to_fp32(x: mx.array, is_products: bool) -> mx.array:
    """fp32 of x, or of bf16(x) for products (cast per reader, so it fuses into each)."""
    return (x.astype(mx.bfloat16) if is_products else x).astype(mx.float32)


def _pairwise_mean(x: mx.array, is_products: bool = False) -> mx.array:
    """Mean of x^2 over the last axis, summed pairwise (halves added until PAIRWISE_LEAF
    remain, then in sequence): it rounds like the reference's fp32 reduction where a
    sequential sum is off by an ulp, and one such ulp in a norm moves a block's whole window
    downstream. Up to LEVELS_FUSED halvings run in one fused kernel, over chunk slices."""
    count = width = x.shape[-1]
    halvings = 0
    while width % 2 == 0 and width > PAIRWISE_LEAF:
        width, halvings = width // 2, halvings + 1
    parts = [_square(to_fp32(part, is_products))
             for part in _chunks(x, 2 ** min(halvings, LEVELS_FUSED))]
    while halvings:
        levels = min(halvings, LEVELS_FUSED)
        for _ in range(levels):
            half = len(parts) // 2
            parts = [a + b for a, b in zip(parts[:half], parts[half:])]
        halvings -= levels
        if halvings:  # the next kernel reads chunks of this one's sums
            parts = _chunks(parts[0], 2 ** min(halvings, LEVELS_FUSED))
    return mx.sum(parts[0], axis=-1, keepdims=True) / count


def _square(x: mx.array) -> mx.array:
    xf = x.astype(mx.float32)
    return xf * xf


def _chunks(x: mx.array, n: int) -> list:
    """x split into n equal slices along the last axis (views)."""
    size = x.shape[-1] // n
    return [x[..., i * size:(i + 1) * size] for i in range(n)]


@functools.cache
def _compiled_rms_norm_pair(eps: float):
    def pair(x, weight):
        out = _rms_norm(x, weight, eps, False)
        return out, out.astype(mx.float32)
    return mx.compile(pair)


@functools.cache
def _compiled_rms_norm(eps: float, is_products: bool):
    """Compiled per eps: on MLX's CPU backend a decode step costs what its op count costs."""
    return mx.compile(functools.partial(_rms_norm, eps=eps, is_products=is_products))
