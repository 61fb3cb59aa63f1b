"""mHC mixes and Sinkhorn of one block side (official inference/model.py L948–994): the
residual copies [B, S, n, D] -> pre, post [B, S, n] and comb [B, S, n, n] (fp32).

`mhc_ops` writes every sum over the n = 4 copies as a chain of adds over slices, in the order
MLX's CPU kernels sum (matmul and reduction alike: from 0, or from eps for the Sinkhorn
normalisations that add it, one term after another), so its results are the bits of the
matmul / reduction form while `mx.compile` fuses each normalisation into one kernel. The Metal
kernel (metal/mhc.metal) does the whole side in one launch per token: the n*D-long sums in
threadgroup memory, then the mixes and the 2 x iters normalisations on one lane.

On MLX's CPU backend every kernel launch costs ~10 us of the main thread, and a decode token's
Sinkhorn is 2 x iters dependent launches on 16 numbers per side (78 of a layer's 214). For a
few tokens on the CPU, `mhc` therefore runs the normalisations in NumPy (`sinkhorn_host`: the
same adds and divides in the same order, so the same bits; checked once per device against
the ops, `host_sinkhorn_exact`), after evaluating the mixes: one host round trip per block side
instead of 2 x iters launches. `Kernels(host_sinkhorn=False)` keeps them in MLX.
"""

from __future__ import annotations

import functools
import warnings

import mlx.core as mx
import numpy as np

from .builder import build_kernel, device_buffer, metal_applies
from .check import assert_close, verified

THREADS = 256  # threads per token's threadgroup
CHECK_TOLERANCE = 2.0 ** -15  # of the largest output: the n*D-long sums run in another order
# At most this many tokens per call have their Sinkhorn in NumPy on the CPU (decode and DSpark
# blocks; a prefill chunk's fused kernels cost little next to its work, and it stays lazy).
HOST_SINKHORN_TOKENS = 64


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


def sinkhorn_host(comb: mx.array, iters: int, eps: float) -> mx.array:
    """`sinkhorn_ops` in NumPy, the same fp32 adds and divides in the same order (row sums
    from 0 for the softmax, from eps after; each sum a chain over the n entries); evaluates
    `comb`. The matrix sits inside an (n+1) x (n+1) buffer whose first row and column hold
    eps, so each sum is the last term of one `np.add.accumulate` (sequential by definition:
    ((eps + c0) + c1) + ...) and each normalisation two NumPy calls, in place."""
    if comb.dtype != mx.float32:
        raise TypeError(f"sinkhorn_host: comb must be float32, got {comb.dtype}")
    # mx.eval first: its errors (a lost peer's collective under tensor parallel) raise, where
    # NumPy's buffer read of an unevaluated array would wait on them forever.
    mx.eval(comb)
    c = np.array(comb)
    lead, n = c.shape[:-2], c.shape[-1]
    e = np.float32(eps)
    buf = np.empty(lead + (n + 1, n + 1), np.float32)
    buf[..., 0, :] = e
    buf[..., :, 0] = e
    m = buf[..., 1:, 1:]
    m[...] = c
    rows, columns = buf[..., 1:, :], buf[..., :, 1:]        # each sum starts from its eps
    row_acc = np.empty(rows.shape, np.float32)
    column_acc = np.empty(columns.shape, np.float32)
    row_sums, column_sums = row_acc[..., -1:], column_acc[..., -1:, :]
    accumulate, divide = np.add.accumulate, np.divide
    accumulate(m, axis=-1, out=row_acc[..., 1:])              # the softmax's sums from 0
    divide(m, row_sums, out=m)
    np.add(m, e, out=m)
    accumulate(columns, axis=-2, out=column_acc)
    divide(m, column_sums, out=m)
    for _ in range(iters - 1):
        accumulate(rows, axis=-1, out=row_acc)
        divide(m, row_sums, out=m)
        accumulate(columns, axis=-2, out=column_acc)
        divide(m, column_sums, out=m)
    return mx.array(m)


@functools.cache
def host_sinkhorn_exact(device: str) -> bool:
    """Whether `sinkhorn_host` gives `sinkhorn_ops`'s bits on `device` (the default device
    when called), checked once on 4,096 random softmax-like matrices, a quarter of them with
    entries spanning tens of orders of magnitude; otherwise False, with one warning (its ops
    are used)."""
    rng = np.random.default_rng(41)
    logits = rng.standard_normal((4096, 4, 4)).astype(np.float32)
    logits[:1024] *= 16.0  # rows whose exps differ by up to ~1e-40: every sum's rounding
    comb = mx.exp(mx.array(logits) - mx.array(logits).max(axis=-1, keepdims=True))
    want = mx.compile(functools.partial(sinkhorn_ops, iters=20, eps=1e-6))(comb)
    got = sinkhorn_host(comb, 20, 1e-6)
    if mx.array_equal(got.view(mx.uint32), want.view(mx.uint32)).item():
        return True
    warnings.warn(f"mHC Sinkhorn in NumPy differs from its MLX ops on {device}; keeping the "
                  "ops", RuntimeWarning, stacklevel=2)
    return False


def _host_applies(streams: mx.array) -> bool:
    """A few tokens, on the CPU, where NumPy's Sinkhorn gives the ops' bits."""
    tokens = streams.size // (streams.shape[-1] * streams.shape[-2])
    device = mx.default_device()
    return tokens <= HOST_SINKHORN_TOKENS and device == mx.cpu and \
        host_sinkhorn_exact(str(device))


def _mixes(streams, fn, base, scale, squares=None, *, iters: int, eps: float, norm_eps: float,
           normalise: bool = True):
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
    return pre, post, sinkhorn_ops(comb, iters, eps) if normalise else comb


@functools.cache
def _compiled_mixes(iters: int, eps: float, norm_eps: float, normalise: bool = True):
    return mx.compile(functools.partial(_mixes, iters=iters, eps=eps, norm_eps=norm_eps,
                                        normalise=normalise))


def mhc_ops(streams, fn, base, scale, iters: int, eps: float, norm_eps: float, squares=None,
            host: bool = False):
    """Reference (pure MLX); arguments as in `mhc`. `host`: the Sinkhorn in NumPy where that
    applies (a few tokens on the CPU; the same bits), which evaluates the mixes."""
    extra = () if squares is None else (squares,)
    if host and _host_applies(streams):
        pre, post, comb = _compiled_mixes(iters, eps, norm_eps, False)(streams, fn, base, scale,
                                                                        *extra)
        try:
            return pre, post, sinkhorn_host(comb, iters, eps)
        except ValueError as e:  # inside a transformation (mx.compile, vmap): no evaluation
            if "function transformations" not in str(e):
                raise
    return _compiled_mixes(iters, eps, norm_eps)(streams, fn, base, scale, *extra)


def build_mhc(metal_kernel=None):
    """The kernel as `run(streams, fn, base, scale, iters, eps, norm_eps)`, built from
    metal/mhc.metal with `metal_kernel` (mx.fast.metal_kernel by default; tests pass the
    simulator)."""
    kernel = build_kernel("v41_mhc", ["streams", "fn", "base", "scale", "iters", "eps",
                                      "norm_eps"], ["pre", "post", "comb"], "mhc.metal",
                          header_files=("mhc.h",), factory=metal_kernel)

    def run(streams, fn, base, scale, iters, eps, norm_eps):
        *lead, n, dim = streams.shape
        tokens = 1
        for size in lead:
            tokens *= size
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

    run.kernel = kernel  # the factory's kernel object (tests read its generated text)
    return run


def mhc_expand_ops(y, residual, post, comb, fn, base, scale, iters: int, eps: float,
                   norm_eps: float, host: bool = False):
    """Reference: the previous side's `expand_pair` (model/mhc.py), then `mhc_ops` of its
    copies -> (streams [B, S, n, D] bf16, pre, post, comb)."""
    from ..model.mhc import expand_pair  # the model's expand (model/mhc.py imports this module)

    streams, streams32, squares = expand_pair(y, residual, post, comb)
    return (streams, *mhc_ops(streams32, fn, base, scale, iters, eps, norm_eps, squares,
                              host=host))


def build_mhc_expand(metal_kernel=None):
    """The expand-then-mix kernel as `run(y, residual, post, comb, fn, base, scale, iters, eps,
    norm_eps)` -> (streams, pre, post, comb), built from metal/mhc_expand.metal."""
    kernel = build_kernel("v41_mhc_expand", ["y", "residual", "hc_post", "hc_comb", "fn", "base",
                                             "scale", "iters", "eps", "norm_eps"],
                          ["streams", "pre", "post", "comb"], "mhc_expand.metal",
                          header_files=("mhc.h",), factory=metal_kernel)

    def run(y, residual, post, comb, fn, base, scale, iters, eps, norm_eps):
        *lead, n, dim = residual.shape
        tokens = 1
        for size in lead:
            tokens *= size
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

    run.kernel = kernel
    return run


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


def build_checked_mhc_expand(metal_kernel=None):
    """`build_mhc_expand(metal_kernel)` if it passes its self-check, else `mhc_expand_ops`."""
    return verified("v41_mhc_expand", lambda: build_mhc_expand(metal_kernel), _probe_expand,
                    mhc_expand_ops)


@functools.cache
def _metal_expand_run():
    return build_checked_mhc_expand()


def mhc_expand(y, residual, post, comb, fn, base, scale, iters: int, eps: float,
               norm_eps: float, use_kernel: bool = True, run=None, host: bool = True):
    """`expand_pair(y, residual, post, comb)` (the previous side's `hc_post`), then `mhc` of
    the copies it makes: one Metal launch per call where the kernel applies (`run`, or Metal
    with `use_kernel`), the two as today otherwise (the same bits).

    Returns:
        (streams [B, S, n, D] bf16, pre [B, S, n], post [B, S, n], comb [B, S, n, n] fp32).
    """
    if run is not None:
        return run(y, residual, post, comb, fn, base, scale, iters, eps, norm_eps)
    if not use_kernel or not metal_applies() or residual.size == 0 or residual.ndim < 3:
        return mhc_expand_ops(y, residual, post, comb, fn, base, scale, iters, eps, norm_eps,
                              host=host)
    return _metal_expand_run()(y, residual, post, comb, fn, base, scale, iters, eps, norm_eps)


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
        use_kernel: bool = True, run=None, streams32=None, squares=None, host: bool = True):
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
        host: the ops' Sinkhorn in NumPy for up to HOST_SINKHORN_TOKENS tokens on the CPU
            (the same bits; evaluates the mixes there).
    Returns:
        (pre [B, S, n], post [B, S, n], comb [B, S, n, n]), fp32.
    """
    if run is not None:
        return run(streams, fn, base, scale, iters, eps, norm_eps)
    if not use_kernel or not metal_applies() or streams.size == 0 or streams.ndim < 3:
        return mhc_ops(streams if streams32 is None else streams32, fn, base, scale, iters, eps,
                       norm_eps, squares if streams32 is not None else None, host=host)
    return _metal_run()(streams, fn, base, scale, iters, eps, norm_eps)
