"""Single-Pass mHC: 4 residual copies mixed by Sinkhorn-normalised matrices
(official inference/model.py L948–994).

`HyperConnection` holds one side's (attention or FFN) parameters, reference names
`hc_{attn,ffn}_{fn,base,scale}`, and returns the per-token `pre`, `post` and `comb` mixes
(kernels/mhc.py: the ops and the Metal kernel). `collapse` and `expand` write their sums over
the copies in MLX's CPU summation order (kernels/mhc.py), so that each is one fused kernel
with the bits of the reduction / matmul form.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..kernels.mhc import mhc, mhc_expand


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
        return mhc(streams, self.fn, self.base, self.scale, self._iters, self._eps,
                   self._norm_eps)

    def after_expand(self, y: mx.array, residual: mx.array, post: mx.array, comb: mx.array):
        """The previous side's `expand(y, residual, post, comb)`, then this side's mixes of the
        copies it makes -> (streams, pre, post, comb): one launch where the fused kernel
        applies (kernels/mhc.py `mhc_expand`; the same values as the two steps)."""
        return mhc_expand(y, residual, post, comb, self.fn, self.base, self.scale,
                          self._iters, self._eps, self._norm_eps)
