"""Single-Pass mHC: 4 residual copies mixed by Sinkhorn-normalised matrices
(official inference/model.py L948–994).

`HyperConnection` holds one side's (attention or FFN) parameters, reference names
`hc_{attn,ffn}_{fn,base,scale}`, and returns the per-token `pre`, `post` and `comb` mixes.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn


@functools.cache
def _constants(n: int, eps: float):
    """All-ones [n, n] (sums as matmuls, already broadcast) and eps [n, n], made once."""
    ones, shift = mx.ones((n, n), dtype=mx.float32), mx.full((n, n), eps, dtype=mx.float32)
    mx.eval(ones, shift)
    return ones, shift


def sinkhorn(comb: mx.array, iters: int, eps: float) -> mx.array:
    """Sinkhorn normalisation of [..., n, n] mixes (compiled once per iters/eps)."""
    return _compiled_sinkhorn(iters, eps)(comb)


@functools.cache
def _compiled_sinkhorn(iters: int, eps: float):
    return mx.compile(functools.partial(_sinkhorn, iters=iters, eps=eps))


def _sinkhorn(comb: mx.array, iters: int, eps: float) -> mx.array:
    """Row softmax, then alternate column/row normalisation; the last step normalises columns.

    Each normalisation is one `addmm` (the sums, already broadcast, plus eps) and one divide:
    this runs once per block side per token, and on MLX's CPU backend op count is the cost.
    """
    ones, shift = _constants(comb.shape[-1], eps)
    comb = mx.exp(comb - mx.max(comb, axis=-1, keepdims=True))
    comb = comb / (comb @ ones) + eps
    comb = comb / mx.addmm(shift, ones, comb)
    for _ in range(iters - 1):
        comb = comb / mx.addmm(shift, comb, ones)
        comb = comb / mx.addmm(shift, ones, comb)
    return comb


class HyperConnection(nn.Module):
    def __init__(self, hc_mult: int, hidden_size: int, sinkhorn_iters: int, hc_eps: float,
                 norm_eps: float):
        super().__init__()
        n = hc_mult
        self.fn = mx.zeros(((2 + n) * n, n * hidden_size), dtype=mx.float32)
        self.base = mx.zeros(((2 + n) * n,), dtype=mx.float32)
        self.scale = mx.zeros((3,), dtype=mx.float32)
        self._n, self._iters, self._eps, self._norm_eps = n, sinkhorn_iters, hc_eps, norm_eps

    def __call__(self, streams: mx.array):
        """`streams` [B, S, n, D] -> pre [B, S, n], post [B, S, n], comb [B, S, n, n] (fp32)."""
        n = self._n
        flat = streams.astype(mx.float32).reshape(*streams.shape[:-2], -1)
        rms = mx.rsqrt(mx.mean(flat * flat, axis=-1, keepdims=True) + self._norm_eps)
        mix = (flat @ self.fn.T) * rms
        pre = mx.sigmoid(mix[..., :n] * self.scale[0] + self.base[:n]) + self._eps
        post = 2 * mx.sigmoid(mix[..., n:2 * n] * self.scale[1] + self.base[n:2 * n])
        comb = mix[..., 2 * n:] * self.scale[2] + self.base[2 * n:]
        comb = sinkhorn(comb.reshape(*comb.shape[:-1], n, n), self._iters, self._eps)
        return pre, post, comb


def collapse(streams: mx.array, pre: mx.array) -> mx.array:
    """`hc_pre`: bf16 of the pre-weighted sum of the copies, [B, S, n, D] -> [B, S, D]."""
    mixed = mx.sum(pre[..., None] * streams.astype(mx.float32), axis=-2)
    return mixed.astype(streams.dtype)


def expand(y: mx.array, residual: mx.array, post: mx.array, comb: mx.array) -> mx.array:
    """`hc_post`: copy b = post_b * y + sum_a comb[a, b] * residual_a, in fp32, rounded to bf16."""
    mixed = mx.einsum("xsac,xsad->xscd", comb, residual.astype(mx.float32))
    out = post[..., None] * y.astype(mx.float32)[..., None, :] + mixed
    return out.astype(residual.dtype)
