"""The ViT encoder of V4.1's vision tower: patch embedding, pre-norm blocks of bidirectional
attention with 2D RoPE and a SwiGLU MLP, final RMSNorm (published names `vision.*`).

The official `inference/vision.py` is unpublished; this follows the reconstruction that four
independent ports agree on. Linears are BF16 with fp32 accumulation and one rounding (bias
included); norms and RoPE run in fp32; attention runs over one image at a time, its query rows
in blocks so the score matrix stays bounded for the largest image (~9,200 patches).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from ..layers import RMSNorm

VIT_NORM_EPS = 1e-6  # the tower's RMSNorm eps (the text model's is 1e-20)
# Query rows per attention block: at most this many score values (heads x rows x patches) at a
# time, 64 MiB in fp32.
SCORE_BLOCK_VALUES = 1 << 24


class Linear(nn.Module):
    """`y = bf16(x W^T + b)`: BF16 weights and input, one rounding of the fp32-accumulated
    sum (what MLX's bf16 `addmm` and matmul compute)."""

    def __init__(self, input_dims: int, output_dims: int, bias: bool = True):
        super().__init__()
        self.weight = mx.zeros((output_dims, input_dims), dtype=mx.bfloat16)
        if bias:
            self.bias = mx.zeros((output_dims,), dtype=mx.bfloat16)

    def __call__(self, x: mx.array) -> mx.array:
        x = x.astype(mx.bfloat16)
        if "bias" in self:
            return mx.addmm(self.bias, x, self.weight.T)
        return x @ self.weight.T


def rope_2d(x: mx.array, rows: mx.array, cols: mx.array, theta: float) -> mx.array:
    """2D rotary embedding, rotate-half form: x [n, H, d] -> bf16. The first half of the
    angles is the patch's row times the inverse frequencies, the second its column;
    inv_freq_j = theta^(-2j / (d/2)), j < d/4 (16 angles per axis at d = 64)."""
    d = x.shape[-1]
    inv_freq = theta ** (-mx.arange(0, d // 2, 2, dtype=mx.float32) / (d // 2))
    angles = mx.concatenate([rows[:, None] * inv_freq, cols[:, None] * inv_freq], axis=-1)
    cos, sin = mx.cos(angles)[:, None, :], mx.sin(angles)[:, None, :]
    xf = x.astype(mx.float32)
    x1, x2 = xf[..., :d // 2], xf[..., d // 2:]
    out = mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(mx.bfloat16)


def blocked_attention(q: mx.array, k: mx.array, v: mx.array, scale: float,
                      block: Optional[int] = None) -> mx.array:
    """Bidirectional attention [H, n, d] x3 -> [H, n, d] bf16, through
    `mx.fast.scaled_dot_product_attention` in blocks of query rows (fp32 inputs), each block
    evaluated before the next so one block's scores are alive at a time."""
    heads, n, _ = q.shape
    block = block or max(1, SCORE_BLOCK_VALUES // (heads * n))
    qf, kf, vf = (t.astype(mx.float32)[None] for t in (q, k, v))
    if block >= n:
        return mx.fast.scaled_dot_product_attention(qf, kf, vf, scale=scale)[0] \
            .astype(mx.bfloat16)
    outs = []
    for i in range(0, n, block):
        out = mx.fast.scaled_dot_product_attention(qf[:, :, i:i + block], kf, vf, scale=scale)
        outs.append(out[0].astype(mx.bfloat16))
        mx.eval(outs[-1])
    return mx.concatenate(outs, axis=1)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, heads: int, theta: float):
        super().__init__()
        self.wqkv = Linear(dim, 3 * dim)
        self.wo = Linear(dim, dim)
        self.heads, self.theta = heads, theta

    def __call__(self, x: mx.array, rows: mx.array, cols: mx.array,
                 block: Optional[int] = None) -> mx.array:
        n, dim = x.shape
        head_dim = dim // self.heads
        qkv = self.wqkv(x).reshape(n, 3, self.heads, head_dim)
        q = rope_2d(qkv[:, 0], rows, cols, self.theta)
        k = rope_2d(qkv[:, 1], rows, cols, self.theta)
        v = qkv[:, 2]
        out = blocked_attention(*(t.transpose(1, 0, 2) for t in (q, k, v)),
                                scale=head_dim ** -0.5, block=block)
        return self.wo(out.transpose(1, 0, 2).reshape(n, dim))


class VisionMLP(nn.Module):
    """SwiGLU: `w1` gives gate | up, `w2(silu(gate) * up)`; no bias, no clamp."""

    def __init__(self, dim: int, inter: int):
        super().__init__()
        self.w1 = Linear(dim, 2 * inter, bias=False)
        self.w2 = Linear(inter, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = mx.split(self.w1(x), 2, axis=-1)
        return self.w2((nn.silu(gate) * up).astype(mx.bfloat16))


class VisionBlock(nn.Module):
    def __init__(self, dim: int, heads: int, inter: int, theta: float):
        super().__init__()
        self.norm1 = RMSNorm(dim, VIT_NORM_EPS)
        self.attn = VisionAttention(dim, heads, theta)
        self.norm2 = RMSNorm(dim, VIT_NORM_EPS)
        self.mlp = VisionMLP(dim, inter)

    def __call__(self, x, rows, cols, block=None):
        x = x + self.attn(self.norm1(x), rows, cols, block)
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    """patches [n, 3 * p * p] of one image (row-major over its `vit_h` x `vit_w` grid) ->
    features [n, hidden] bf16."""

    def __init__(self, cfg):
        super().__init__()
        dim, patch = cfg.hidden_size, cfg.patch_size
        self.patch_embed = nn.Module()
        self.patch_embed.proj = Linear(3 * patch * patch, dim)
        self.blocks = [VisionBlock(dim, cfg.num_attention_heads, cfg.intermediate_size,
                                   cfg.rope_theta) for _ in range(cfg.num_hidden_layers)]
        self.norm = RMSNorm(dim, VIT_NORM_EPS)

    def __call__(self, patches: mx.array, vit_h: int, vit_w: int,
                 capture: Optional[dict] = None, block: Optional[int] = None) -> mx.array:
        if patches.shape[0] != vit_h * vit_w:
            raise ValueError(f"{patches.shape[0]} patches for a {vit_h}x{vit_w} grid")
        position = mx.arange(vit_h * vit_w)
        rows = (position // vit_w).astype(mx.float32)
        cols = (position % vit_w).astype(mx.float32)
        x = self.patch_embed.proj(patches)
        _record(capture, "patch_embed", x)
        for i, layer in enumerate(self.blocks):
            x = layer(x, rows, cols, block)
            _record(capture, f"vit.blocks.{i}.out", x)
        return self.norm(x)


def _record(capture: Optional[dict], name: str, value: mx.array) -> None:
    if capture is not None:
        capture[name] = value
