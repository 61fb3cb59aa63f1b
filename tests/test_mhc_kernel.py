"""The mHC kernels through the Metal simulator against their ops, with races and coverage
checked: metal/mhc.metal (mixes + Sinkhorn of one block side in one launch per token) within its
stated tolerance, 2^-15 of the largest output (its n*D-long sums run in another order; measured
up to 1.2e-6 relative at D = 512); metal/mhc_expand.metal (the previous side's expand, then the
mixes) with the same tolerance for the mixes and the copies within one bf16 ulp, almost all
equal; and block sides of the tiny golden model."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_v41.kernels import Kernels
from mlx_v41.kernels.mhc import CHECK_TOLERANCE, MHC, MHC_EXPAND, mhc
from mlx_v41.numerics.mhc import mhc_expand_ops, mhc_ops
from tests.kernel_faults import checked

pytestmark = pytest.mark.usefixtures("cpu")


def _close(got, want):
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == mx.float32
        error = mx.abs(g - w).max().item()
        assert error <= CHECK_TOLERANCE * mx.abs(w).max().item(), error


@pytest.mark.parametrize("lead,dim,iters", [((1, 1), 512, 20), ((2, 3), 48, 20),
                                            ((1, 5), 128, 1), ((1, 2), 1280, 7)])
def test_mhc_kernel_matches_ops(lead, dim, iters):
    rng = np.random.default_rng(dim + iters)
    streams = mx.array(rng.standard_normal(lead + (4, dim)).astype(np.float32) * 4)
    streams = streams.astype(mx.bfloat16)
    fn = mx.array(rng.standard_normal((24, 4 * dim)).astype(np.float32) * (0.5 / dim ** 0.5))
    base = mx.array(rng.standard_normal(24).astype(np.float32))
    scale = mx.array(rng.uniform(0.5, 3.0, 3).astype(np.float32))
    args = (streams, fn, base, scale, iters, 1e-6, 1e-6)
    _close(MHC.build(checked)(*args), mhc_ops(*args))


def test_mhc_kernel_on_a_model_block(goldens, tiny_model):
    """The tiny golden's layer-3 attention side on the streams its prefill hands that layer."""
    model = tiny_model()
    captured = {}
    model(goldens("tiny").prompt[None, :9].astype(mx.int32), capture=captured)
    streams = captured["layers.2.out"]
    hc = model.model.layers[3].attn_hc
    args = (streams, hc.fn, hc.base, hc.scale, hc._iters, hc._eps, hc._norm_eps)
    _close(mhc(*args, run=MHC.build(checked)), mhc(*args, use_kernel=False))


def _expand_args(rng, lead, dim, iters, y_dtype):
    residual = mx.array(rng.standard_normal(lead + (4, dim)).astype(np.float32) * 4)
    y = mx.array(rng.standard_normal(lead + (dim,)).astype(np.float32) * 3).astype(y_dtype)
    post = mx.array(rng.uniform(0, 2, lead + (4,)).astype(np.float32))
    comb = mx.softmax(mx.array(rng.standard_normal(lead + (4, 4)).astype(np.float32)), axis=-1)
    fn = mx.array(rng.standard_normal((24, 4 * dim)).astype(np.float32) * (0.5 / dim ** 0.5))
    base = mx.array(rng.standard_normal(24).astype(np.float32))
    scale = mx.array(rng.uniform(0.5, 3.0, 3).astype(np.float32))
    return (y, residual.astype(mx.bfloat16), post, comb, fn, base, scale, iters, 1e-6, 1e-6)


def _streams_close(got, want):
    """Every copy value within one bf16 ulp of the ops' (the kernel may fuse a multiply-add
    that the ops round twice), and at most 1 % of them differing."""
    g, w = got.astype(mx.float32), want.astype(mx.float32)
    ulp = mx.maximum(mx.abs(w), 2.0 ** -126) * 2.0 ** -7
    assert got.dtype == mx.bfloat16 and got.shape == want.shape
    assert mx.all(mx.abs(g - w) <= ulp).item()
    assert mx.mean((g != w).astype(mx.float32)).item() <= 0.01


@pytest.mark.parametrize("lead,dim,iters,y_dtype", [((1, 1), 512, 20, mx.float32),
                                                    ((2, 3), 48, 20, mx.bfloat16),
                                                    ((1, 2), 1280, 3, mx.float32)])
def test_mhc_expand_kernel_matches_ops(lead, dim, iters, y_dtype):
    args = _expand_args(np.random.default_rng(dim), lead, dim, iters, y_dtype)
    got, want = MHC_EXPAND.build(checked)(*args), mhc_expand_ops(*args)
    _streams_close(got[0], want[0])
    _close(got[1:], want[1:])


def test_mhc_expand_kernel_in_a_model_block(goldens, tiny_model):
    """The tiny golden's blocks with each expand and the next side's mixes through the kernel
    (Block's `after_expand` within a block, and its final expand handing the next block its
    attention-side mixes): the same block outputs as the ops, to the tolerance of the copies'
    bf16 rounding; and the kernel is what ran."""
    ids = goldens("tiny").prompt[None, :9].astype(mx.int32)
    reference = tiny_model()
    fused = tiny_model()
    calls = []
    run = MHC_EXPAND.build(checked)
    fused.kernels = Kernels(mhc_expand=lambda *a: calls.append(1) or run(*a))
    want, got = {}, {}
    reference(ids, capture=want)
    fused(ids, capture=got)
    # one per block (its FFN side) and one per block whose final expand also makes the next
    # block's attention-side mixes: within each stack, unless the next one writes Engram
    layers, start = fused.model.layers, fused.model.decoder_start
    handed = [k for k in range(len(layers) - 1) if k + 1 != start
              and layers[k + 1].role.engram_index is None]
    assert len(calls) == len(layers) + len(handed)
    for layer in (0, 3):
        g, w = got[f"layers.{layer}.out"], want[f"layers.{layer}.out"]
        assert mx.abs(g.astype(mx.float32) - w.astype(mx.float32)).max().item() <= \
            0.02 * mx.abs(w.astype(mx.float32)).max().item()
