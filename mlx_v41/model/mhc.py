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
from ..kernels.mhc import mhc, mhc_expand
from ..numerics.mhc import expand_pair


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


