"""mHC kernels of one block side (official inference/model.py L948–994): the residual copies
[B, S, n, D] -> pre, post [B, S, n] and comb [B, S, n, n] (fp32), and the expand that makes the
copies followed by those mixes. The ops are `numerics/mhc.py`'s; the Metal kernels
(metal/mhc.metal, metal/mhc_expand.metal) do a whole side in one launch per token: the n*D-long
sums in threadgroup memory, then the mixes and the 2 x iters normalisations on one lane.
On the CPU the ops run the Sinkhorn of a few tokens in NumPy (`Kernels(host_sinkhorn=False)`
keeps it in MLX).
"""

from __future__ import annotations

import math
from typing import Optional

import mlx.core as mx

from ..numerics.mhc import HOST_SINKHORN_TOKENS, expand_pair, mhc_expand_ops, mhc_ops
from .builder import device_buffer
from .check import assert_close
from .context import evaluations_short, host_sinkhorn
from .spec import KernelSpec

THREADS = 256  # threads per token's threadgroup
CHECK_TOLERANCE = 2.0 ** -15  # of the largest output: the n*D-long sums run in another order


def _launch(kernel, streams, fn, base, scale, iters, eps, norm_eps):
    *lead, n, dim = streams.shape
    tokens = math.prod(lead)
    # `scale` has 3 values: padded to 8 so it binds as a device buffer like the others.
    scale8 = device_buffer(scale)
    pre, post, comb = kernel(
        inputs=[streams.reshape(tokens, n, dim).astype(mx.bfloat16), fn.astype(mx.float32),
                base.astype(mx.float32), scale8, int(iters), float(eps), float(norm_eps)],
        template=[("N", n), ("THREADS", THREADS)], grid=(THREADS, tokens, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(tokens, n), (tokens, n), (tokens, n, n)],
        output_dtypes=[mx.float32] * 3)
    return pre.reshape(*lead, n), post.reshape(*lead, n), comb.reshape(*lead, n, n)


def _launch_expand(kernel, y, residual, post, comb, fn, base, scale, iters, eps, norm_eps):
    *lead, n, dim = residual.shape
    tokens = math.prod(lead)
    if y.dtype not in (mx.float32, mx.bfloat16):
        raise TypeError(f"mhc_expand: y must be float32 products or bfloat16, got {y.dtype}")
    streams, pre, post_out, comb_out = kernel(
        inputs=[y.reshape(tokens, dim), residual.reshape(tokens, n, dim).astype(mx.bfloat16),
                post.reshape(tokens, n).astype(mx.float32),
                comb.reshape(tokens, n, n).astype(mx.float32), fn.astype(mx.float32),
                base.astype(mx.float32), device_buffer(scale), int(iters), float(eps),
                float(norm_eps)],
        template=[("N", n), ("THREADS", THREADS)], grid=(THREADS, tokens, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(tokens, n, dim), (tokens, n), (tokens, n), (tokens, n, n)],
        output_dtypes=[mx.bfloat16] + [mx.float32] * 3)
    return (streams.reshape(*lead, n, dim), pre.reshape(*lead, n),
            post_out.reshape(*lead, n), comb_out.reshape(*lead, n, n))


def _probe_expand(run, ops) -> None:
    """Two tokens of 4 copies of 64 channels, y as fp32 products: the copies within one bf16
    ulp (the kernel's multiply-adds may round once where the ops round twice), the mixes
    within the mHC kernel's tolerance."""
    wave = lambda n, f: mx.sin(mx.arange(n, dtype=mx.float32) * f)  # noqa: E731
    residual = (wave(2 * 4 * 64, 0.31) * 3).reshape(1, 2, 4, 64).astype(mx.bfloat16)
    comb = mx.softmax(wave(2 * 16, 0.9).reshape(1, 2, 4, 4), axis=-1)
    args = (wave(2 * 64, 0.23).reshape(1, 2, 64) * 2, residual,
            mx.sigmoid(wave(8, 0.5)).reshape(1, 2, 4) * 2, comb,
            wave(24 * 256, 0.017).reshape(24, 256) * 0.1, wave(24, 0.7),
            mx.array([0.9, 1.3, 2.1]), 20, 1e-6, 1e-6)
    got, want = run(*args), ops(*args)
    assert_close("mhc_expand streams", got[0], want[0], 2.0 ** -8)
    for name, g, w in zip(("pre", "post", "comb"), got[1:], want[1:]):
        assert_close(f"mhc_expand {name}", g, w, CHECK_TOLERANCE)


# The expand-then-mix kernel as `run(y, residual, post, comb, fn, base, scale, iters, eps,
# norm_eps)` -> (streams, pre, post, comb): metal/mhc_expand.metal.
MHC_EXPAND = KernelSpec(
    "v41_mhc_expand", "mhc_expand",
    ("y", "residual", "hc_post", "hc_comb", "fn", "base", "scale", "iters", "eps", "norm_eps"),
    ("streams", "pre", "post", "comb"), "mhc_expand.metal", _launch_expand, _probe_expand,
    mhc_expand_ops, headers=("mhc.h",), exact=False)


def mhc_expand(y, residual, post, comb, fn, base, scale, iters: int, eps: float,
               norm_eps: float, use_kernel: Optional[bool] = None, run=None,
               host: Optional[bool] = None):
    """`expand_pair(y, residual, post, comb)` (the previous side's `hc_post`), then `mhc` of
    the copies it makes: one Metal launch per call where the fused kernel applies (`run`, or
    Metal with `use_kernel`), else the expand and then `mhc` (its own kernel where one is
    active, else its ops; the same bits as `mhc_expand_ops`).

    Returns:
        (streams [B, S, n, D] bf16, pre [B, S, n], post [B, S, n], comb [B, S, n, n] fp32).
    """
    given = use_kernel
    run = MHC_EXPAND.choose(use_kernel, run, applies=residual.size > 0 and residual.ndim >= 3)
    if run is not None:
        return run(y, residual, post, comb, fn, base, scale, iters, eps, norm_eps)
    streams, streams32, squares = expand_pair(y, residual, post, comb)
    return (streams, *mhc(streams, fn, base, scale, iters, eps, norm_eps, use_kernel=given,
                          streams32=streams32, squares=squares, host=host))


def _probe(run, ops) -> None:
    """Three tokens of 4 copies of 64 channels."""
    wave = lambda n, f: mx.sin(mx.arange(n, dtype=mx.float32) * f)  # noqa: E731
    streams = (wave(3 * 4 * 64, 0.31) * 3).reshape(1, 3, 4, 64).astype(mx.bfloat16)
    args = (streams, wave(24 * 256, 0.017).reshape(24, 256) * 0.1, wave(24, 0.7),
            mx.array([0.9, 1.3, 2.1]), 20, 1e-6, 1e-6)
    for name, got, want in zip(("pre", "post", "comb"), run(*args), ops(*args)):
        assert_close(f"mhc {name}", got, want, CHECK_TOLERANCE)


# The kernel as `run(streams, fn, base, scale, iters, eps, norm_eps)`: metal/mhc.metal.
MHC = KernelSpec("v41_mhc", "mhc", ("streams", "fn", "base", "scale", "iters", "eps", "norm_eps"),
                 ("pre", "post", "comb"), "mhc.metal", _launch, _probe, mhc_ops,
                 headers=("mhc.h",), exact=False)


def mhc(streams, fn, base, scale, iters: int, eps: float, norm_eps: float,
        use_kernel: Optional[bool] = None, run=None, streams32=None, squares=None,
        host: Optional[bool] = None):
    """pre, post and comb mixes of one block side.

    Args:
        streams: [B, S, n, D] residual copies (bf16).
        fn: [(2 + n) n, n D] fp32 mix weights; base [(2 + n) n], scale [3] fp32.
        iters: Sinkhorn iterations; eps: hc_eps; norm_eps: the RMS normalisation's eps.
        use_kernel: use the Metal kernel when it applies.
        run: an already built kernel (`MHC.build(factory)`) to use unconditionally, e.g. the
            Metal simulator's in tests.
        streams32: optional fp32 copy of `streams` (same values) for the ops, which read fp32
            (saves them a cast); the kernel reads `streams`.
        squares: optional streams32 * streams32 for the ops' RMS (saves them a kernel); only
            with `streams32`.
        host: the ops' Sinkhorn in NumPy for up to HOST_SINKHORN_TOKENS tokens on the CPU
            (the same bits; evaluates the mixes there), for any number within
            `short_evaluations` (the prompt thread evaluates in short steps anyway, and the
            compiled Sinkhorn of a long piece is hundreds of operations in one evaluation);
            None: the active set's choice.
    Returns:
        (pre [B, S, n], post [B, S, n], comb [B, S, n, n]), fp32.
    """
    run = MHC.choose(use_kernel, run, applies=streams.size > 0 and streams.ndim >= 3)
    if run is not None:
        return run(streams, fn, base, scale, iters, eps, norm_eps)
    host = host_sinkhorn() if host is None else host
    return mhc_ops(streams if streams32 is None else streams32, fn, base, scale, iters, eps,
                   norm_eps, squares if streams32 is not None else None, host=host,
                   host_tokens=math.inf if evaluations_short() else HOST_SINKHORN_TOKENS)
