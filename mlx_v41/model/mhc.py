"""Single-Pass mHC: 4 residual copies mixed by Sinkhorn-normalised matrices
(official inference/model.py L948–994).

`HyperConnection` holds one side's (attention or FFN) parameters, reference names
`hc_{attn,ffn}_{fn,base,scale}`, and returns the per-token `pre`, `post` and `comb` mixes
(kernels/mhc.py: the ops and the Metal kernel). `collapse` and `expand` write their sums over
the copies in MLX's CPU summation order (kernels/mhc.py), so that each is one fused kernel
with the bits of the reduction / matmul form.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from ..kernels import Kernels
from ..kernels.builder import metal_applies
from ..kernels.mhc import along, chain_sum, mhc, mhc_expand


class HyperConnection(nn.Module):
    def __init__(self, hc_mult: int, hidden_size: int, sinkhorn_iters: int, hc_eps: float,
                 norm_eps: float):
        super().__init__()
        n = hc_mult
        self.fn = mx.zeros(((2 + n) * n, n * hidden_size), dtype=mx.float32)
        self.base = mx.zeros(((2 + n) * n,), dtype=mx.float32)
        self.scale = mx.zeros((3,), dtype=mx.float32)
        self._iters, self._eps, self._norm_eps = sinkhorn_iters, hc_eps, norm_eps

    def __call__(self, streams: mx.array, kernels: Optional[Kernels] = None,
                 streams32: Optional[mx.array] = None, squares: Optional[mx.array] = None):
        """`streams` [B, S, n, D] -> pre [B, S, n], post [B, S, n], comb [B, S, n, n] (fp32).
        `streams32`, `squares`: the same values in fp32 and their squares when the caller
        has them (`expand_pair`)."""
        kernels = kernels or Kernels()
        return mhc(streams, self.fn, self.base, self.scale, self._iters, self._eps,
                   self._norm_eps, use_kernel=kernels.use, run=kernels.mhc, streams32=streams32,
                   squares=squares, host=kernels.host_sinkhorn)

    @staticmethod
    def fuses_expand(kernels: Kernels) -> bool:
        """Whether `after_expand` runs as one fused launch with these kernels."""
        return kernels.mhc_expand is not None or (kernels.use and metal_applies())

    def after_expand(self, y: mx.array, residual: mx.array, post: mx.array, comb: mx.array,
                     kernels: Optional[Kernels] = None):
        """The previous side's `expand_pair(y, residual, post, comb)`, then this side's mixes
        of the copies it makes -> (streams, pre, post, comb): one launch where the fused
        kernel applies (kernels/mhc.py `mhc_expand`), the two steps as before otherwise."""
        kernels = kernels or Kernels()
        if self.fuses_expand(kernels):
            return mhc_expand(y, residual, post, comb, self.fn, self.base, self.scale,
                              self._iters, self._eps, self._norm_eps, run=kernels.mhc_expand)
        streams, streams32, squares = expand_pair(y, residual, post, comb)
        return (streams, *self(streams, kernels, streams32, squares))


def collapse(streams: mx.array, pre: mx.array) -> mx.array:
    """`hc_pre`: bf16 of the pre-weighted sum of the copies, [B, S, n, D] -> [B, S, D]."""
    return _compiled_collapse(streams, pre)


@mx.compile
def _compiled_collapse(streams: mx.array, pre: mx.array) -> mx.array:
    terms = [w * s[..., 0, :].astype(mx.float32)
             for w, s in zip(along(pre, -1), along(streams, -2))]
    return chain_sum(terms, 0.0).astype(streams.dtype)


def expand(y: mx.array, residual: mx.array, post: mx.array, comb: mx.array) -> mx.array:
    """`hc_post`: copy b = post_b * y + sum_a comb[a, b] * residual_a, in fp32, rounded to bf16.
    `y` is the bf16 block output, or fp32 products that round to it (rounded here, fused)."""
    return _compiled_expand(y, residual, post, comb)


def expand_pair(y: mx.array, residual: mx.array, post: mx.array, comb: mx.array):
    """`expand`, its bf16 result as fp32 and the squares of that (for the next mixes, whose
    RMS would otherwise square them in a kernel of their own), from one fused kernel."""
    return _compiled_expand_pair(y, residual, post, comb)


@mx.compile
def _compiled_expand_pair(y, residual, post, comb):
    out = _expand(y, residual, post, comb)
    out32 = out.astype(mx.float32)
    return out, out32, out32 * out32


@mx.compile
def _compiled_expand(y, residual, post, comb) -> mx.array:
    return _expand(y, residual, post, comb)


def _expand(y, residual, post, comb) -> mx.array:
    # [B, S, n(b), D] from the n terms a: comb row a [B, S, n(b), 1] x residual a [B, S, 1, D]
    terms = [row.swapaxes(-1, -2) * r.astype(mx.float32)
             for row, r in zip(along(comb, -2), along(residual, -2))]
    y = y[..., None, :].astype(mx.bfloat16).astype(mx.float32)
    out = post[..., None] * y + chain_sum(terms, 0.0)
    return out.astype(residual.dtype)
