"""Single-Pass mHC: 4 residual copies mixed by Sinkhorn-normalised matrices
(official inference/model.py L948–994).

`HyperConnection` holds one side's (attention or FFN) parameters, reference names
`hc_{attn,ffn}_{fn,base,scale}`, and returns the per-token `pre`, `post` and `comb` mixes.

Every sum over the n = 4 copies is written as a chain of adds over slices, in the order
MLX's CPU kernels sum (matmul and reduction alike: from 0, or from eps for the Sinkhorn
normalisations that add it, one term after another), so the results are the bits of the
matmul / reduction form while `mx.compile` fuses each normalisation, the mixes and the
collapse / expand into single element-wise kernels (a decode step is op-bound).
"""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn


def _chain_sum(parts: list, start=None):
    """((start + p0) + p1) + ...: the summation order of MLX's CPU matmul and reductions."""
    total = start
    for part in parts:
        total = part if total is None else total + part
    return total


def _along(x: mx.array, axis: int) -> list:
    """Size-1 slices of x along `axis`: views from one split (on MLX's CPU backend every graph
    node costs a few microseconds, views included, so one split beats n slices)."""
    return mx.split(x, x.shape[axis], axis=axis)


def sinkhorn(comb: mx.array, iters: int, eps: float) -> mx.array:
    """Sinkhorn normalisation of [..., n, n] mixes (compiled once per iters/eps)."""
    return _compiled_sinkhorn(iters, eps)(comb)


@functools.cache
def _compiled_sinkhorn(iters: int, eps: float):
    return mx.compile(functools.partial(_sinkhorn, iters=iters, eps=eps))


def _sinkhorn(comb: mx.array, iters: int, eps: float) -> mx.array:
    return _normalise(_row_softmax(comb, _along(comb, -1)), iters, eps)


def _row_softmax(comb: mx.array, columns: list) -> mx.array:
    """exp(comb - the max of its row); `columns` are comb's columns, possibly computed apart
    (same bits) so that comb need not be made before the fused exp."""
    return mx.exp(comb - functools.reduce(mx.maximum, columns))


def _normalise(comb: mx.array, iters: int, eps: float) -> mx.array:
    """Row normalisation of the softmax, then alternate column/row normalisation; the last
    step normalises columns. The softmax's row sum starts from 0 (a matmul by ones), the
    normalisations' sums from eps (an addmm of eps); each normalisation is one fused kernel."""
    comb = comb / _chain_sum(_along(comb, -1)) + eps
    comb = comb / _chain_sum(_along(comb, -2), eps)
    for _ in range(iters - 1):
        comb = comb / _chain_sum(_along(comb, -1), eps)
        comb = comb / _chain_sum(_along(comb, -2), eps)
    return comb


def _mixes(streams, fn, base, scale, iters: int, eps: float, norm_eps: float):
    """`hc_mixes` + Sinkhorn: streams [B, S, n, D] -> pre, post [B, S, n], comb [B, S, n, n].
    Each mix is scaled by the rms inside its own kernel (the same multiply, fused)."""
    n = streams.shape[-2]
    flat = streams.astype(mx.float32).reshape(*streams.shape[:-2], -1)
    rms = mx.rsqrt(mx.mean(flat * flat, axis=-1, keepdims=True) + norm_eps)
    mix = flat @ fn.T
    pre = mx.sigmoid(mix[..., :n] * rms * scale[0:1] + base[:n]) + eps
    post = 2 * mx.sigmoid(mix[..., n:2 * n] * rms * scale[1:2] + base[n:2 * n])
    raw = mix[..., 2 * n:].reshape(*mix.shape[:-1], n, n)
    rms, shift = rms[..., None], base[2 * n:].reshape(n, n)

    def affine(x, bias):
        return x * rms * scale[2:3] + bias

    columns = [affine(x, b) for x, b in zip(_along(raw, -1), _along(shift, -1))]
    comb = _row_softmax(affine(raw, shift), columns)
    return pre, post, _normalise(comb, iters, eps)


@functools.cache
def _compiled_mixes(iters: int, eps: float, norm_eps: float):
    return mx.compile(functools.partial(_mixes, iters=iters, eps=eps, norm_eps=norm_eps))


class HyperConnection(nn.Module):
    def __init__(self, hc_mult: int, hidden_size: int, sinkhorn_iters: int, hc_eps: float,
                 norm_eps: float):
        super().__init__()
        n = hc_mult
        self.fn = mx.zeros(((2 + n) * n, n * hidden_size), dtype=mx.float32)
        self.base = mx.zeros(((2 + n) * n,), dtype=mx.float32)
        self.scale = mx.zeros((3,), dtype=mx.float32)
        self._iters, self._eps, self._norm_eps = sinkhorn_iters, hc_eps, norm_eps

    def __call__(self, streams: mx.array):
        """`streams` [B, S, n, D] -> pre [B, S, n], post [B, S, n], comb [B, S, n, n] (fp32)."""
        mixes = _compiled_mixes(self._iters, self._eps, self._norm_eps)
        return mixes(streams, self.fn, self.base, self.scale)


def collapse(streams: mx.array, pre: mx.array) -> mx.array:
    """`hc_pre`: bf16 of the pre-weighted sum of the copies, [B, S, n, D] -> [B, S, D]."""
    return _compiled_collapse(streams, pre)


@mx.compile
def _compiled_collapse(streams: mx.array, pre: mx.array) -> mx.array:
    terms = [w * s[..., 0, :].astype(mx.float32)
             for w, s in zip(_along(pre, -1), _along(streams, -2))]
    return _chain_sum(terms, 0.0).astype(streams.dtype)


def expand(y: mx.array, residual: mx.array, post: mx.array, comb: mx.array) -> mx.array:
    """`hc_post`: copy b = post_b * y + sum_a comb[a, b] * residual_a, in fp32, rounded to bf16."""
    return _compiled_expand(y, residual, post, comb)


@mx.compile
def _compiled_expand(y, residual, post, comb) -> mx.array:
    # [B, S, n(b), D] from the n terms a: comb row a [B, S, n(b), 1] x residual a [B, S, 1, D]
    terms = [row.swapaxes(-1, -2) * r.astype(mx.float32)
             for row, r in zip(_along(comb, -2), _along(residual, -2))]
    out = post[..., None] * y[..., None, :].astype(mx.float32) + _chain_sum(terms, 0.0)
    return out.astype(residual.dtype)
