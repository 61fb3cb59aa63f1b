"""Values that one fused kernel now hands to the next (to save a launch per layer) are the
bits of the separate ops they replace: the squares `expand_pair` writes for the FFN-side
mixes' RMS, and the router's top-k key -(scores + bias)."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_v41.numerics.mhc import expand, expand_pair, mhc_ops
from mlx_v41.model.moe import Router, _sqrt_softplus

pytestmark = pytest.mark.usefixtures("cpu")


def same_bits(a: mx.array, b: mx.array) -> bool:
    return a.dtype == b.dtype and np.array_equal(np.array(a.astype(mx.float32)).view(np.uint32),
                                                 np.array(b.astype(mx.float32)).view(np.uint32))


def test_expand_pair_squares_feed_the_mixes_bit_for_bit():
    rng = np.random.default_rng(1)
    dim = 96
    y = mx.array(rng.standard_normal((1, 3, dim)).astype(np.float32))
    residual = mx.array(rng.standard_normal((1, 3, 4, dim)).astype(np.float32)).astype(mx.bfloat16)
    post = mx.array(rng.uniform(0, 2, (1, 3, 4)).astype(np.float32))
    comb = mx.array(rng.uniform(0, 1, (1, 3, 4, 4)).astype(np.float32))
    out, out32, squares = expand_pair(y, residual, post, comb)
    assert same_bits(out, expand(y, residual, post, comb))
    assert same_bits(out32, out.astype(mx.float32))
    assert same_bits(squares, out32 * out32)
    fn = mx.array(rng.standard_normal((24, 4 * dim)).astype(np.float32) * 0.05)
    base = mx.array(rng.standard_normal(24).astype(np.float32))
    scale = mx.array([0.9, 1.3, 2.1])
    args = (out32, fn, base, scale, 20, 1e-6, 1e-6)
    for got, want in zip(mhc_ops(*args, squares), mhc_ops(*args)):
        assert same_bits(got, want)
    # the squares are what the RMS reads: other squares, other mixes
    assert not same_bits(mhc_ops(*args, squares * 2)[0], mhc_ops(*args)[0])


@pytest.mark.parametrize("with_image", [False, True])
def test_router_key_from_the_scores_kernel(with_image):
    rng = np.random.default_rng(2)
    router = Router(64, 16, 4, 1.5)
    router.weight = mx.array(rng.standard_normal((16, 64)).astype(np.float32) * 0.3)
    router.e_score_correction_bias = mx.array(rng.standard_normal(16).astype(np.float32) * 0.1)
    router.bias_vl = mx.array(rng.standard_normal(16).astype(np.float32) * 0.1)
    x = mx.array(rng.standard_normal((2, 5, 64)).astype(np.float32)).astype(mx.bfloat16)
    mask = mx.array(rng.integers(0, 2, (2, 5)).astype(bool)) if with_image else None
    ids, weights = router.select(x, mask)
    # the separate ops it replaces
    scores = _sqrt_softplus(x.astype(mx.float32) @ router.weight.T)
    bias = router.e_score_correction_bias
    if mask is not None:
        bias = mx.where(mask[..., None], router.bias_vl, bias)
    want = mx.argpartition(-(scores + bias), 3, axis=-1)[..., :4]
    assert np.array_equal(np.array(ids), np.array(want))
    picked = mx.take_along_axis(scores, want, axis=-1)
    assert same_bits(weights, picked / (picked.sum(-1, keepdims=True) + 1e-20) * 1.5)
