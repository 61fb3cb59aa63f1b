"""The mHC kernel (metal/mhc.metal: mixes + Sinkhorn of one block side in one launch per token)
through the Metal simulator against `mhc_ops`, within the kernel's stated tolerance: 2^-15 of
the largest output (its n*D-long sums run in another order; measured up to 1.2e-6 relative at
D = 512), with races and coverage checked; and a block side of the tiny golden model."""

import functools

import mlx.core as mx
import numpy as np
import pytest

import mlx_v41
from conftest import golden_checkpoint
from mlx_v41.kernels.mhc import CHECK_TOLERANCE, build_mhc, mhc, mhc_ops
from tests.metal_sim import SimOptions, metal_kernel

pytestmark = pytest.mark.usefixtures("cpu")

checked = functools.partial(metal_kernel, options=SimOptions(check_races=True,
                                                             check_coverage=True))


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
    _close(build_mhc(checked)(*args), mhc_ops(*args))


def test_mhc_kernel_on_a_model_block(goldens):
    """The tiny golden's layer-3 attention side on the streams its prefill hands that layer."""
    model = mlx_v41.load_model(golden_checkpoint("tiny"))
    captured = {}
    model(goldens("tiny").prompt[None, :9].astype(mx.int32), capture=captured)
    streams = captured["layers.2.out"]
    hc = model.model.layers[3].attn_hc
    args = (streams, hc.fn, hc.base, hc.scale, hc._iters, hc._eps, hc._norm_eps)
    _close(mhc(*args, run=build_mhc(checked)), mhc(*args, use_kernel=False))

