"""The mHC Sinkhorn in NumPy (`sinkhorn_host`), which decode runs on the CPU instead of 2 x iters
MLX launches per block side, has the bits of the MLX ops (`sinkhorn_ops`); decode uses it and
prefill chunks do not, except in short evaluations (the prompt thread); a device where the
bits differ keeps the ops, with one warning; inside `mx.compile` (no evaluation allowed) the
ops run."""

import functools
import warnings

import mlx.core as mx
import numpy as np
import pytest

import mlx_v41.numerics.mhc as mhc_module
from mlx_v41.kernels import Kernels
from mlx_v41.kernels.context import short_evaluations
from mlx_v41.kernels.mhc import mhc
from mlx_v41.numerics.mhc import HOST_SINKHORN_TOKENS, mhc_ops, sinkhorn_host, sinkhorn_ops

pytestmark = pytest.mark.usefixtures("cpu")


def bits(a: mx.array) -> np.ndarray:
    return np.array(a).view(np.uint32)


def softmax_like(shape, spread: float, seed: int) -> mx.array:
    logits = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * spread
    x = mx.array(logits)
    return mx.exp(x - x.max(axis=-1, keepdims=True))


@pytest.mark.parametrize("shape,spread,iters,eps", [
    ((1, 1, 4, 4), 1.0, 20, 1e-6),       # one decode token, the published settings
    ((2, 7, 4, 4), 4.0, 20, 1e-6),       # a batch of DSpark-sized blocks
    ((3000, 4, 4), 20.0, 20, 1e-6),      # entries spanning ~90 binades
    ((64, 3, 3), 2.0, 5, 1e-3),          # another n, iteration count and eps
])
def test_host_sinkhorn_has_the_ops_bits(shape, spread, iters, eps):
    comb = softmax_like(shape, spread, seed=len(shape) + iters)
    want = mx.compile(functools.partial(sinkhorn_ops, iters=iters, eps=eps))(comb)
    got = sinkhorn_host(comb, iters, eps)
    assert got.dtype == mx.float32 and got.shape == comb.shape
    assert np.array_equal(bits(got), bits(want))
    assert np.array_equal(bits(got), bits(sinkhorn_ops(comb, iters, eps)))  # uncompiled too


def test_host_sinkhorn_refuses_other_dtypes():
    with pytest.raises(TypeError, match="sinkhorn_host: comb must be float32, got .*bfloat16"):
        sinkhorn_host(softmax_like((1, 4, 4), 1.0, 0).astype(mx.bfloat16), 20, 1e-6)


def mixes_args(tokens: int, dim: int = 32):
    rng = np.random.default_rng(tokens)
    streams = mx.array(rng.standard_normal((1, tokens, 4, dim)).astype(np.float32))
    fn = mx.array(rng.standard_normal((24, 4 * dim)).astype(np.float32) * 0.3)
    base = mx.array(rng.standard_normal(24).astype(np.float32))
    return streams, fn, base, mx.array([0.9, 1.3, 2.1]), 20, 1e-6, 1e-6


class Calls:
    """Counts `sinkhorn_host` calls (and can perturb its result) through a monkeypatch."""

    def __init__(self, monkeypatch, perturb: bool = False):
        self.count, real = 0, mhc_module.sinkhorn_host
        if not perturb:  # the device's check ran (with the real function), not counted
            assert mhc_module.host_sinkhorn_exact(str(mx.default_device()))

        def counted(comb, iters, eps):
            self.count += 1
            out = real(comb, iters, eps)
            return out * (1 + 2.0 ** -20) if perturb else out

        monkeypatch.setattr(mhc_module, "sinkhorn_host", counted)


def test_few_tokens_use_numpy_and_many_the_ops(monkeypatch):
    calls = Calls(monkeypatch)
    for tokens in (1, HOST_SINKHORN_TOKENS, HOST_SINKHORN_TOKENS + 1):
        args = mixes_args(tokens)
        before = calls.count
        got, want = mhc_ops(*args, host=True), mhc_ops(*args)
        assert calls.count - before == (tokens <= HOST_SINKHORN_TOKENS), tokens
        for g, w in zip(got, want):
            assert np.array_equal(bits(g), bits(w))


def test_short_evaluations_take_numpy_for_any_number_of_tokens(monkeypatch):
    """Within `short_evaluations` (the prompt thread) `mhc` runs the Sinkhorn of a long piece
    in NumPy too, with the bits of the ops: the compiled Sinkhorn would be one evaluation of
    hundreds of operations; outside, a long piece stays lazy on the ops."""
    calls = Calls(monkeypatch)
    args = mixes_args(4 * HOST_SINKHORN_TOKENS)
    want = mhc_ops(*args)
    got = mhc(*args)
    assert calls.count == 0
    with short_evaluations():
        short = mhc(*args)
    assert calls.count == 1
    for g, s, w in zip(got, short, want):
        assert np.array_equal(bits(s), bits(w)) and np.array_equal(bits(g), bits(w))


def test_inside_mx_compile_the_ops_run(monkeypatch):
    args = mixes_args(2)
    compiled = mx.compile(lambda s, f, b, sc: mhc_ops(s, f, b, sc, *args[4:], host=True)[2])
    assert np.array_equal(bits(compiled(*args[:4])), bits(mhc_ops(*args)[2]))


def test_a_device_where_the_bits_differ_keeps_the_ops(monkeypatch):
    Calls(monkeypatch, perturb=True)
    mhc_module.host_sinkhorn_exact.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            args = mixes_args(1)
            got = mhc_ops(*args, host=True)
            mhc_ops(*args, host=True)  # checked once per device: no second warning
        messages = [str(w.message) for w in caught if w.category is RuntimeWarning]
        assert messages == ["mHC Sinkhorn in NumPy differs from its MLX ops on Device(cpu, 0); "
                            "keeping the ops"], messages
        assert np.array_equal(bits(got[2]), bits(mhc_ops(*args)[2]))
    finally:
        mhc_module.host_sinkhorn_exact.cache_clear()


def test_decode_runs_the_sinkhorn_in_numpy_with_the_same_logits(monkeypatch, tiny_model):
    """A decode step calls `sinkhorn_host` twice per layer (both block sides) and gives the
    logits of the all-MLX graph (`Kernels(host_sinkhorn=False)`) bit for bit; the prompt's
    prefill (more than HOST_SINKHORN_TOKENS tokens) does not call it."""
    model = tiny_model()
    calls = Calls(monkeypatch)
    ids = mx.array(np.arange(3, 3 + HOST_SINKHORN_TOKENS + 16)[None], dtype=mx.int32)
    results = {}
    for host in (False, True):
        model.kernels = Kernels(use=False, host_sinkhorn=host)
        cache = model.make_cache()
        mx.eval(model(ids, cache=cache))
        prefill_calls = calls.count
        logits = model(mx.array([[7]], dtype=mx.int32), cache=cache)
        mx.eval(logits)
        results[host] = (prefill_calls, calls.count - prefill_calls, logits)
    assert results[False][:2] == (0, 0)
    assert results[True][:2] == (0, 2 * model.cfg.num_hidden_layers)
    assert np.array_equal(bits(results[True][2]), bits(results[False][2]))
