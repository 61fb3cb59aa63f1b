"""mHC mixes and Sinkhorn of one block side (official inference/model.py L948–994): the
residual copies [B, S, n, D] -> pre, post [B, S, n] and comb [B, S, n, n] (fp32).

`mhc_ops` writes every sum over the n = 4 copies as a chain of adds over slices, in the order
MLX's CPU kernels sum (matmul and reduction alike: from 0, or from eps for the Sinkhorn
normalisations that add it, one term after another), so its results are the bits of the
matmul / reduction form while `mx.compile` fuses each normalisation into one kernel. The Metal
kernel (metal/mhc.metal) does the whole side in one launch per token: the n*D-long sums in
threadgroup memory, then the mixes and the 2 x iters normalisations on one lane.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from .builder import build_kernel, metal_applies
from .check import assert_close, verified

THREADS = 256  # threads per token's threadgroup
CHECK_TOLERANCE = 2.0 ** -15  # of the largest output: the n*D-long sums run in another order


def chain_sum(parts: list, start=None):
    """((start + p0) + p1) + ...: the summation order of MLX's CPU matmul and reductions."""
    total = start
    for part in parts:
        total = part if total is None else total + part
    return total


def along(x: mx.array, axis: int) -> list:
    """Size-1 slices of x along `axis`: views from one split (on MLX's CPU backend every graph
    node costs a few microseconds, views included, so one split beats n slices)."""
    return mx.split(x, x.shape[axis], axis=axis)


def _row_softmax(comb: mx.array, columns: list) -> mx.array:
    """exp(comb - the max of its row); `columns` are comb's columns, possibly computed apart
    (same bits) so that comb need not be made before the fused exp."""
    return mx.exp(comb - functools.reduce(mx.maximum, columns))


def sinkhorn_ops(comb: mx.array, iters: int, eps: float) -> mx.array:
    """Row normalisation of the softmax, then alternate column/row normalisation; the last
    step normalises columns. The softmax's row sum starts from 0 (a matmul by ones), the
    normalisations' sums from eps (an addmm of eps); each normalisation is one fused kernel."""
    comb = comb / chain_sum(along(comb, -1)) + eps
    comb = comb / chain_sum(along(comb, -2), eps)
    for _ in range(iters - 1):
        comb = comb / chain_sum(along(comb, -1), eps)
        comb = comb / chain_sum(along(comb, -2), eps)
    return comb


def _mixes(streams, fn, base, scale, squares=None, *, iters: int, eps: float, norm_eps: float):
    n = streams.shape[-2]
    flat = streams.astype(mx.float32).reshape(*streams.shape[:-2], -1)
    squares = flat * flat if squares is None else squares.reshape(flat.shape)
    rms = mx.rsqrt(mx.mean(squares, axis=-1, keepdims=True) + norm_eps)
    mix = flat @ fn.T
    # Each mix is scaled by the rms inside its own kernel (the same multiply, fused).
    pre = mx.sigmoid(mix[..., :n] * rms * scale[0:1] + base[:n]) + eps
    post = 2 * mx.sigmoid(mix[..., n:2 * n] * rms * scale[1:2] + base[n:2 * n])
    raw = mix[..., 2 * n:].reshape(*mix.shape[:-1], n, n)
    rms, shift = rms[..., None], base[2 * n:].reshape(n, n)

    def affine(x, bias):
        return x * rms * scale[2:3] + bias

    columns = [affine(x, b) for x, b in zip(along(raw, -1), along(shift, -1))]
    comb = _row_softmax(affine(raw, shift), columns)
    return pre, post, sinkhorn_ops(comb, iters, eps)


@functools.cache
def _compiled_mixes(iters: int, eps: float, norm_eps: float):
    return mx.compile(functools.partial(_mixes, iters=iters, eps=eps, norm_eps=norm_eps))


def mhc_ops(streams, fn, base, scale, iters: int, eps: float, norm_eps: float, squares=None):
    """Reference (pure MLX); arguments as in `mhc`."""
    extra = () if squares is None else (squares,)
    return _compiled_mixes(iters, eps, norm_eps)(streams, fn, base, scale, *extra)


def build_mhc(metal_kernel=None):
    """The kernel as `run(streams, fn, base, scale, iters, eps, norm_eps)`, built from
    metal/mhc.metal with `metal_kernel` (mx.fast.metal_kernel by default; tests pass the
    simulator)."""
    kernel = build_kernel("v41_mhc", ["streams", "fn", "base", "scale", "iters", "eps",
                                      "norm_eps"], ["pre", "post", "comb"], "mhc.metal",
                          factory=metal_kernel)

    def run(streams, fn, base, scale, iters, eps, norm_eps):
        *lead, n, dim = streams.shape
        tokens = 1
        for size in lead:
            tokens *= size
        # `scale` has 3 values: padded to 8 so it binds as a device buffer like the others.
        scale8 = mx.concatenate([scale.astype(mx.float32), mx.zeros((5,), mx.float32)])
        pre, post, comb = kernel(
            inputs=[streams.reshape(tokens, n, dim).astype(mx.bfloat16), fn.astype(mx.float32),
                    base.astype(mx.float32), scale8, int(iters), float(eps), float(norm_eps)],
            template=[("N", n), ("THREADS", THREADS)], grid=(THREADS, tokens, 1),
            threadgroup=(THREADS, 1, 1),
            output_shapes=[(tokens, n), (tokens, n), (tokens, n, n)],
            output_dtypes=[mx.float32] * 3)
        return pre.reshape(*lead, n), post.reshape(*lead, n), comb.reshape(*lead, n, n)

    run.kernel = kernel  # the factory's kernel object (tests read its generated text)
    return run


def _probe(run, ops) -> None:
    """Three tokens of 4 copies of 64 channels."""
    wave = lambda n, f: mx.sin(mx.arange(n, dtype=mx.float32) * f)  # noqa: E731
    streams = (wave(3 * 4 * 64, 0.31) * 3).reshape(1, 3, 4, 64).astype(mx.bfloat16)
    args = (streams, wave(24 * 256, 0.017).reshape(24, 256) * 0.1, wave(24, 0.7),
            mx.array([0.9, 1.3, 2.1]), 20, 1e-6, 1e-6)
    for name, got, want in zip(("pre", "post", "comb"), run(*args), ops(*args)):
        assert_close(f"mhc {name}", got, want, CHECK_TOLERANCE)


def build_checked_mhc(metal_kernel=None):
    """`build_mhc(metal_kernel)` if it passes its self-check, else `mhc_ops`."""
    return verified("v41_mhc", lambda: build_mhc(metal_kernel), _probe, mhc_ops)


@functools.cache
def _metal_run():
    return build_checked_mhc()


def mhc(streams, fn, base, scale, iters: int, eps: float, norm_eps: float,
        use_kernel: bool = True, run=None, streams32=None, squares=None):
    """pre, post and comb mixes of one block side.

    Args:
        streams: [B, S, n, D] residual copies (bf16).
        fn: [(2 + n) n, n D] fp32 mix weights; base [(2 + n) n], scale [3] fp32.
        iters: Sinkhorn iterations; eps: hc_eps; norm_eps: the RMS normalisation's eps.
        use_kernel: use the Metal kernel when it applies.
        run: an already built kernel (`build_*(factory)`) to use unconditionally, e.g. the
            Metal simulator's in tests.
        streams32: optional fp32 copy of `streams` (same values) for the ops, which read fp32
            (saves them a cast); the kernel reads `streams`.
        squares: optional streams32 * streams32 for the ops' RMS (saves them a kernel); only
            with `streams32`.
    Returns:
        (pre [B, S, n], post [B, S, n], comb [B, S, n, n]), fp32.
    """
    if run is not None:
        return run(streams, fn, base, scale, iters, eps, norm_eps)
    if not use_kernel or not metal_applies() or streams.size == 0 or streams.ndim < 3:
        return mhc_ops(streams if streams32 is None else streams32, fn, base, scale, iters, eps,
                       norm_eps, squares if streams32 is not None else None)
    return _metal_run()(streams, fn, base, scale, iters, eps, norm_eps)
