"""The aligner: 3x3 pixel-unshuffle of the ViT features, then a GELU MLP into the text width
(published names `aligner.w1`, `aligner.w2`). Its rows are the embeddings of an image's IMAGE
positions in reading order.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .vit import Linear


def unshuffle(features: mx.array, vit_h: int, vit_w: int, ratio: int) -> mx.array:
    """[vit_h * vit_w, C] -> [cells, C * ratio^2]: the grid zero-padded at the bottom and right
    to multiples of `ratio`; cell (Y, X) takes patches (ratio*Y + ky, ratio*X + kx) at feature
    index c * ratio^2 + ky * ratio + kx (channel-major)."""
    channels = features.shape[-1]
    grid = features.reshape(vit_h, vit_w, channels)
    pad_h, pad_w = -vit_h % ratio, -vit_w % ratio
    if pad_h or pad_w:
        grid = mx.pad(grid, [(0, pad_h), (0, pad_w), (0, 0)])
    llm_h, llm_w = (vit_h + pad_h) // ratio, (vit_w + pad_w) // ratio
    cells = grid.reshape(llm_h, ratio, llm_w, ratio, channels).transpose(0, 2, 4, 1, 3)
    return cells.reshape(llm_h * llm_w, channels * ratio * ratio)


class Aligner(nn.Module):
    """ViT features of one image -> [cells, hidden] bf16: `w2(gelu(w1(unshuffle(x))))`, exact
    (erf) GELU, both linears with bias."""

    def __init__(self, vision_dim: int, ratio: int, hidden: int):
        super().__init__()
        self.w1 = Linear(vision_dim * ratio * ratio, hidden)
        self.w2 = Linear(hidden, hidden)
        self.ratio = ratio

    def __call__(self, features: mx.array, vit_h: int, vit_w: int) -> mx.array:
        cells = unshuffle(features, vit_h, vit_w, self.ratio)
        return self.w2(nn.gelu(self.w1(cells).astype(mx.float32)).astype(mx.bfloat16))
