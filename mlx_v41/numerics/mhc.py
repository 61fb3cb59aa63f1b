"""mHC arithmetic (official inference/model.py L948–994): the mixes and Sinkhorn of one block
side, and `collapse` (hc_pre) / `expand` (hc_post) of the residual copies [B, S, n, D].

Every sum over the n = 4 copies is written as a chain of adds over slices, in the order MLX's CPU
kernels sum (matmul and reduction alike: from 0, or from eps for the Sinkhorn normalisations
that add it, one term after another), so the results are the bits of the matmul / reduction form
while `mx.compile` fuses each step into one kernel.

On MLX's CPU backend every kernel launch costs ~10 us of the main thread, and a decode token's
Sinkhorn is 2 x iters dependent launches on 16 numbers per side. For a few tokens on the CPU,
`mhc_ops(host=True)` therefore runs the normalisations in NumPy (`sinkhorn_host`: the same adds
and divides in the same order, so the same bits; checked once per device against the ops,
`host_sinkhorn_exact`), after evaluating the mixes: one host round trip per block side. The
prompt thread, which evaluates its pieces in short steps anyway, does so at any length
(`mhc_ops(host_tokens=...)`).
"""

from __future__ import annotations

import functools
import warnings

import mlx.core as mx
import numpy as np

# At most this many tokens per call have their Sinkhorn in NumPy on the CPU (decode and DSpark
# blocks; a prefill chunk's fused kernels cost little next to its work, and it stays lazy),
# unless the caller evaluates in short steps anyway (`mhc_ops(host_tokens=...)`).
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


def _host_applies(streams: mx.array, limit: float) -> bool:
    """At most `limit` tokens, on the CPU, where NumPy's Sinkhorn gives the ops' bits."""
    tokens = streams.size // (streams.shape[-1] * streams.shape[-2])
    device = mx.default_device()
    return tokens <= limit and device == mx.cpu and \
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
            host: bool = False, host_tokens: float = HOST_SINKHORN_TOKENS):
    """Reference (pure MLX); arguments as in `mhc`. `host`: the Sinkhorn in NumPy where that
    applies (up to `host_tokens` tokens on the CPU; the same bits), which evaluates the
    mixes."""
    extra = () if squares is None else (squares,)
    if host and _host_applies(streams, host_tokens):
        pre, post, comb = _compiled_mixes(iters, eps, norm_eps, False)(streams, fn, base, scale,
                                                                        *extra)
        try:
            return pre, post, sinkhorn_host(comb, iters, eps)
        except ValueError as e:  # inside a transformation (mx.compile, vmap): no evaluation
            if "function transformations" not in str(e):
                raise
    return _compiled_mixes(iters, eps, norm_eps)(streams, fn, base, scale, *extra)


def mhc_expand_ops(y, residual, post, comb, fn, base, scale, iters: int, eps: float,
                   norm_eps: float, host: bool = False):
    """Reference: the previous side's `expand_pair`, then `mhc_ops` of its
    copies -> (streams [B, S, n, D] bf16, pre, post, comb)."""
    streams, streams32, squares = expand_pair(y, residual, post, comb)
    return (streams, *mhc_ops(streams32, fn, base, scale, iters, eps, norm_eps, squares,
                              host=host))


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
