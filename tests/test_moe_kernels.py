"""The MoE's fused Metal-path kernels through the Metal simulator (races and coverage checked)
against their ops, and the MoE's fused routed sum + combine against today's form.

* router (`router_logits`, MLX's matmul, then metal/router.metal on the fp32 logits): the same
  experts as the ops, their weights within 2^-19 of the row's largest weight (measured: at most
  3.3e-7, 2^-21.5, over 4096 random rows each of logits in [-30, 30], N(0, 3^2), N(0, 0.3^2)
  and the softplus's linear part, top 6 and 8 of 256). Not the ops' bits: the simulator's
  libm exp and the kernel's log1p (MLX's Metal formula) against MLX's CPU polynomial exp and
  libm log1p leave 39% of scores an ulp or more apart (up to 15 ulps, in the deep negative
  tail), and even with equal scores the kernel sums the k picked scores in pick order, the ops
  in argpartition's (19% of top-6 weights differ where every logit is above 20). Where neither
  applies (logits above 20: sqrt is correctly rounded on both; k <= 2: a sum of two in either
  order) the weights are the ops' bits. Ties go to the lower id; the ids come in decreasing
  key order, so they are compared as sets (`by_id`).
* swiglu_act_fp8 (metal/swiglu_act_fp8.metal): every value within one E4M3 step of its
  block's scale (2^-3 of the block's amax) and at most 1 in 10^3 values differing at all
  (measured: none of 10^6 random values differ; only exp's last bit, MLX's CPU exp against the
  simulator's libm one, could move a bf16 rounding).
* moe_order (metal/moe_order.metal): the pairs in expert order for the sorted expert gather,
  one launch instead of the ops' six; a permutation, so the ops' bits (rows, ids, weights and
  places), ties in pair order as MLX's stable argsort leaves them; and the tiny model with it
  on a prompt long enough to sort (40 tokens x top 2 >= 64 pairs), bit for bit.
* the routed sum + combine as one compiled kernel (a chain of adds over the experts): the bits
  of `mx.sum` and `_add_shared` on the CPU, so it runs on every path.
* the tiny golden model with both kernels: its logits within 0.05 of the ops' over 8 prompt
  positions and 2 decode steps (measured: 0, the same bits: 2 experts sum in either order
  alike, and the weights' last-ulp differences vanish in the bf16 roundings; the model is
  chaotic, so only early positions), and with the kernels' ops in their place (a failed
  self-check) bit for bit.
"""

import functools

import mlx.core as mx
import numpy as np
import pytest

from mlx_v41.kernels import Kernels
from mlx_v41.kernels.context import using
from mlx_v41.kernels.moe_order import MAX_PAIRS, MOE_ORDER, moe_order, moe_order_ops
from mlx_v41.kernels.router import ROUTER, by_id, router, router_logits, router_ops, select_ops
from mlx_v41.kernels.swiglu import SWIGLU_ACT_FP8, swiglu_act_fp8, swiglu_act_fp8_ops
from mlx_v41.model.layers import round_act_fp8
from mlx_v41.model.moe import _add_shared, _bf16_rounded, _routed_and_shared
from tests.kernel_faults import checked, not_compiling, returning, sim, warnings_of

pytestmark = pytest.mark.usefixtures("cpu")

ROUTER_TOLERANCE = 2.0 ** -19   # of the row's largest weight (measured 2^-21.5)
SWIGLU_BLOCK_TOLERANCE = 2.0 ** -3  # of the block's amax: one E4M3 step at its top
SWIGLU_DIFFERING = 1e-3  # at most this fraction of values differing (measured 0)
LOGITS_TOLERANCE = 0.05  # absolute, tiny model's early logits (measured 0)


@functools.cache
def _router_run():
    return ROUTER.build(checked)


@functools.cache
def _swiglu_run():
    return SWIGLU_ACT_FP8.build(checked)


@functools.cache
def _moe_order_run():
    return MOE_ORDER.build(checked)


def _router_case(seed: int, tokens: int, dim: int, experts: int):
    """Rows whose logits reach the softplus's linear part (> 20) and its deep negative tail,
    and selection biases large enough that the keys' order is not the scores'."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, dim)).astype(np.float32)
    weight = rng.standard_normal((experts, dim)).astype(np.float32) / np.sqrt(dim)
    weight[: experts // 4] *= 30.0  # logits of tens, both signs
    bias = rng.standard_normal((2, experts)).astype(np.float32) * 0.5
    mask = rng.random(tokens) < 0.5
    return mx.array(x), mx.array(weight), mx.array(bias[0]), mx.array(bias[1]), mx.array(mask)


def _assert_router_close(got, want) -> None:
    """The same ids per row; each weight within ROUTER_TOLERANCE of its row's largest."""
    (gi, gw), (wi, ww) = by_id(*got), by_id(*want)
    assert gi.dtype == mx.uint32 and gw.dtype == mx.float32
    assert np.array_equal(np.array(gi), np.array(wi).astype(np.uint32))
    gw, ww = np.array(gw), np.array(ww)
    scale = np.abs(ww).max(axis=-1, keepdims=True)
    assert (np.abs(gw - ww) <= ROUTER_TOLERANCE * scale).all(), np.abs(gw - ww).max()


@pytest.mark.parametrize("tokens,dim,experts,top_k,masked", [
    (5, 64, 8, 2, False), (3, 96, 40, 6, True), (2, 128, 256, 6, True), (7, 32, 33, 1, False),
    (1, 5120, 256, 6, False), (37, 64, 256, 6, True), (9, 32, 7, 7, True)])
def test_router_kernel_matches_ops(tokens, dim, experts, top_k, masked):
    """Decode rows, a prefill chunk of 37 rows (threadgroups of 8 rows and an edge one of 5),
    the real model's 5120 x 256, and every expert picked (7 of 7)."""
    x, weight, bias, bias_vl, mask = _router_case(tokens + experts, tokens, dim, experts)
    args = (x, weight, bias, bias_vl, mask if masked else None, top_k, 1.5)
    _assert_router_close(_router_run()(*args), router_ops(*args))


def test_router_kernel_selects_from_adversarial_logits():
    """Logits at the softplus threshold and an ulp either side, -0, -inf, the deep negative
    tail, tiny and large values, with biases that reorder them: the kernel's selection from
    the same logits as the ops'."""
    rng = np.random.default_rng(11)
    special = np.array([20.0, np.nextafter(20.0, 0.0), np.nextafter(20.0, 40.0), -0.0, 0.0,
                        -np.inf, -87.0, -89.0, -1e30, 1e-30, 1e4, 3e38], np.float32)
    logits = rng.standard_normal((6, 96)).astype(np.float32) * 10
    for r in range(6):
        logits[r, rng.choice(96, special.size, replace=False)] = special
    bias = rng.standard_normal((2, 96)).astype(np.float32) * 2
    args = (mx.array(logits), mx.array(bias[0]), mx.array(bias[1]),
            mx.array([True, False, True, True, False, False]), 8, 2.5)
    _assert_router_close(_router_run().select(*args), select_ops(*args))


@pytest.mark.parametrize("top_k", [1, 2])
def test_router_kernel_keeps_the_bits_where_the_math_is_the_same(top_k):
    """Logits above the softplus threshold (score = sqrt(logit), correctly rounded on both)
    and at most two picked scores (one sum in either order): the ops' weights bit for bit."""
    rng = np.random.default_rng(top_k)
    logits = mx.array(rng.uniform(20.5, 500.0, (13, 64)).astype(np.float32))
    bias = mx.array(rng.standard_normal((2, 64)).astype(np.float32) * 4)
    args = (logits, bias[0], bias[1], mx.array(rng.random(13) < 0.5), top_k, 2.5)
    (gi, gw), (wi, ww) = by_id(*_router_run().select(*args)), by_id(*select_ops(*args))
    assert mx.array_equal(gi, wi).item() and mx.array_equal(gw, ww).item()


def test_router_kernel_reads_any_row_shape_and_dtype():
    """[B, S, D] bf16 rows (the model's x when it has no fp32 copy) and a [B, S] image mask."""
    x, weight, bias, bias_vl, mask = _router_case(3, 6, 64, 16)
    x, mask = x.reshape(2, 3, 64).astype(mx.bfloat16), mask.reshape(2, 3)
    args = (x, weight, bias, bias_vl, mask, 4, 2.5)
    got = _router_run()(*args)
    assert got[0].shape == (2, 3, 4) and got[1].shape == (2, 3, 4)
    _assert_router_close(got, router_ops(*args))
    assert router_logits(x, weight).dtype == mx.float32


def test_router_kernel_orders_by_key_and_breaks_ties_by_lower_id():
    """Equal keys everywhere (72 experts: ties within a lane's and across lanes' experts):
    experts 0..k-1 with equal weights; then one bias lifts expert 41 to the front at the row
    that selects with `bias`, while its weight stays its score's share."""
    x = mx.ones((2, 32))
    weight = mx.zeros((72, 32))
    bias = mx.zeros((72,))
    ids, weights = _router_run()(x, weight, bias, bias, None, 3, 1.5)
    assert np.array(ids).tolist() == [[0, 1, 2], [0, 1, 2]]
    assert np.allclose(np.array(weights), 0.5)
    lifted = mx.where(mx.arange(72) == 41, 1.0, 0.0)
    ids, weights = _router_run()(x, weight, lifted, bias, mx.array([True, False]), 3, 1.5)
    assert np.array(ids).tolist() == [[0, 1, 2], [41, 0, 1]]
    assert np.allclose(np.array(weights), 0.5)


def test_router_rejects_bad_arguments():
    x, weight, bias, bias_vl, _ = _router_case(0, 2, 32, 8)
    run = _router_run()
    with pytest.raises(ValueError, match="top_k 9 of 8 experts"):
        run(x, weight, bias, bias_vl, None, 9, 1.0)
    with pytest.raises(ValueError, match="does not fit weight"):
        run(x[:, :16], weight, bias, bias_vl, None, 2, 1.0)
    with pytest.raises(ValueError, match="logits must be float32"):
        run.select(router_logits(x, weight).astype(mx.float16), bias, bias_vl, None, 2, 1.0)
    with pytest.raises(ValueError, match="do not fit 8 experts"):
        run(x, weight, bias[:4], bias_vl, None, 2, 1.0)
    with pytest.raises(ValueError, match="does not fit the rows"):
        run(x, weight, bias, bias_vl, mx.array([True]), 2, 1.0)


def test_router_dispatcher():
    """A built kernel for any number of rows (decode and prefill chunks alike), its empty
    result for no rows; off Metal the ops' bits."""
    x, weight, bias, bias_vl, _ = _router_case(1, 40, 32, 8)
    calls = []

    def counted(*args):
        calls.append(args[0].shape)
        return router_ops(*args)

    router(x[:4], weight, bias, bias_vl, None, 2, 1.0, run=counted)
    router(x, weight, bias, bias_vl, None, 2, 1.0, run=counted)
    assert calls == [(4, 32), (40, 32)]
    ids, weights = router(x[:0], weight, bias, bias_vl, None, 2, 1.0, run=_router_run())
    assert ids.shape == weights.shape == (0, 2)
    got = router(x, weight, bias, bias_vl, None, 2, 1.0)              # off Metal: the ops
    want = router_ops(x, weight, bias, bias_vl, None, 2, 1.0)
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))


def _products(seed: int, shape: tuple) -> tuple:
    """gate / up fp32 products of mixed magnitudes, past the clamp on both sides, exactly at
    it, zero (an all-zero block), and up to 1e30."""
    rng = np.random.default_rng(seed)
    g, u = (rng.standard_normal(shape) * rng.choice([0.3, 3.0, 30.0], shape) for _ in range(2))
    g.reshape(-1)[::7], u.reshape(-1)[::11] = 10.0, -10.0
    g.reshape(-1)[::13], u.reshape(-1)[::17] = -1e30, 1e30
    g.reshape(-1, 32)[::5] = 0.0
    return mx.array(g.astype(np.float32)), mx.array(u.astype(np.float32))


def _assert_swiglu_close(got: mx.array, want: mx.array) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype == mx.float32
    g, w = np.array(got).reshape(-1, 32), np.array(want).reshape(-1, 32)
    amax = np.abs(w).max(axis=-1, keepdims=True)
    assert (np.abs(g - w) <= SWIGLU_BLOCK_TOLERANCE * amax).all()
    assert (g != w).mean() <= SWIGLU_DIFFERING, (g != w).sum()


@pytest.mark.parametrize("shape,weighted", [
    ((37, 3, 1, 64), True), ((29, 1, 96), True), ((11, 64), False), ((1, 6, 1, 32), True)])
def test_swiglu_act_fp8_kernel_matches_ops(shape, weighted):
    """The routed experts' shapes (unsorted [T, k, 1, I], sorted [T*k, 1, I]) with one weight
    per row, and the shared expert's [T, I] without."""
    gate, up = _products(sum(shape), shape)
    weights = None
    if weighted:
        weights = mx.array(np.random.default_rng(5).uniform(0, 1.5, shape[:-1] + (1,))
                           .astype(np.float32))
    got = _swiglu_run()(gate, up, weights, 10.0)
    want = swiglu_act_fp8_ops(gate, up, weights, 10.0)
    _assert_swiglu_close(got, want)
    assert (np.array(want) != 0).mean() > 0.5  # the comparison is not of zeros


def test_swiglu_act_fp8_dispatcher():
    """Off Metal: the ops' bits and errors; with a built kernel: the kernel."""
    gate, up = _products(3, (4, 64))
    assert mx.array_equal(swiglu_act_fp8(gate, up, None, 7.0),
                          swiglu_act_fp8_ops(gate, up, None, 7.0)).item()
    with pytest.raises(ValueError, match="multiple of the group size 32"):
        swiglu_act_fp8(gate[:, :48], up[:, :48], None, 7.0, run=_swiglu_run())
    with pytest.raises(ValueError, match="3 weights for 4 rows"):
        _swiglu_run()(gate, up, mx.ones((3, 1)), 7.0)
    calls = []
    swiglu_act_fp8(gate, up, None, 7.0, run=lambda *args: calls.append(args) or args[0])
    assert len(calls) == 1 and calls[0][2:] == (None, 7.0)


def _pairs(seed: int, tokens: int, top_k: int, experts: int, dim: int, dtype=mx.float32):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)])
    return (mx.array(ids.reshape(-1).astype(np.uint32)),
            mx.array(rng.uniform(0, 2, tokens * top_k).astype(np.float32)).astype(dtype),
            mx.array(rng.standard_normal((tokens, dim)).astype(np.float32)).astype(dtype))


@pytest.mark.parametrize("tokens,top_k,experts,dim,dtype", [
    (32, 6, 384, 64, mx.float32),     # a batched decode step: few ties
    (40, 6, 7, 96, mx.float32),       # ties everywhere: equal experts keep pair order
    (11, 6, 6, 32, mx.bfloat16),      # every token picks every expert; bf16 rows
    (1, 1, 3, 8, mx.float32),         # one pair
    (300, 2, 8, 160, mx.float32)])    # a prefill piece of the tiny model's shape
def test_moe_order_kernel_matches_ops(tokens, top_k, experts, dim, dtype):
    ids, weights, x = _pairs(tokens + experts, tokens, top_k, experts, dim, dtype)
    got = _moe_order_run()(ids, weights, x, top_k)
    want = moe_order_ops(ids, weights, x, top_k)
    for name, a, b in zip(("rows", "ids", "weights", "place"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert mx.array_equal(a, b).item(), name
    rows, sorted_ids, _, place = got  # what the MoE relies on, not only equality with the ops
    assert (np.diff(np.array(sorted_ids).astype(np.int64)) >= 0).all()
    assert mx.array_equal(sorted_ids[place], ids).item()
    assert mx.array_equal(rows[place], mx.repeat(x, top_k, axis=0)).item()


def test_moe_order_dispatcher():
    """Off Metal the ops; a built kernel for 1 to MAX_PAIRS pairs, the ops beyond; arguments
    that do not fit are named."""
    ids, weights, x = _pairs(2, 20, 4, 16, 32)
    got = moe_order(ids, weights, x, 4)
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, moe_order_ops(ids, weights, x, 4)))
    calls = []

    def counted(*args):
        calls.append(args[0].shape[0])
        return moe_order_ops(*args)

    moe_order(ids, weights, x, 4, run=counted)
    many = _pairs(3, MAX_PAIRS // 2 + 1, 2, 16, 8)
    moe_order(*many, 2, run=counted)
    assert calls == [80]
    with pytest.raises(ValueError, match=r"moe_order: ids \(80,\) .* 3 experts .* \(20, 32\)"):
        moe_order(ids, weights, x, 3)


_ONES = returning(lambda outputs: [mx.zeros_like(out) + 1 for out in outputs], name="ones")


@pytest.mark.parametrize("factory,reason", [(not_compiling(), "MetalCompileError"),
                                            (_ONES, "KernelMismatch")])
@pytest.mark.parametrize("build,name,ops", [
    (ROUTER.build_checked, "v41_router", router_ops),
    (SWIGLU_ACT_FP8.build_checked, "v41_swiglu_act_fp8", swiglu_act_fp8_ops),
    (MOE_ORDER.build_checked, "v41_moe_order", moe_order_ops)])
def test_a_failing_kernel_warns_once_and_runs_its_ops(build, name, ops, factory, reason):
    run, messages = warnings_of(build, factory)
    assert run is ops
    assert len(messages) == 1 and name in messages[0] and reason in messages[0], messages
    run, caught = warnings_of(build, sim, category=None)
    assert run is not ops and not caught


@pytest.mark.parametrize("k", [6, 2, 1])
def test_routed_sum_and_combine_fused_keep_the_bits(k):
    """The chain of adds over the k experts, fused with the bf16 roundings and the shared add:
    `mx.sum` + `_add_shared`'s bits, signed zeros included."""
    rng = np.random.default_rng(k)
    routed = rng.standard_normal((9, k, 256)) * np.exp(rng.standard_normal((9, k, 256)) * 4)
    routed[rng.random(routed.shape) < 0.3] = -0.0
    shared = rng.standard_normal((9, 256)) * 10
    shared[rng.random(shared.shape) < 0.3] = -0.0
    routed, shared = mx.array(routed.astype(np.float32)), mx.array(shared.astype(np.float32))
    want = _add_shared(mx.sum(_bf16_rounded(routed), axis=1), shared)
    got = _routed_and_shared(routed, shared)
    assert mx.array_equal(got.view(mx.uint16), want.view(mx.uint16)).item()


def _logits(model, ids: mx.array) -> mx.array:
    """8 prompt positions, then two decode steps, concatenated."""
    cache = model.make_cache()
    steps = [model(ids, cache=cache)]
    for token in (3, 4):
        steps.append(model(mx.array([[token]], dtype=mx.int32), cache=cache))
    return mx.concatenate(steps, axis=1)


def test_model_with_the_kernels_matches_the_ops(tiny_model, goldens):
    calls = {"router": 0, "swiglu": 0}

    def counted(name, run):
        def call(*args):
            calls[name] += 1
            return run(*args)
        return call

    ids = goldens("tiny").prompt[None, :8].astype(mx.int32)
    model = tiny_model(Kernels(router=counted("router", ROUTER.build(sim)),
                               swiglu_act_fp8=counted("swiglu", SWIGLU_ACT_FP8.build(sim))))
    reference = tiny_model(Kernels(use=False))
    got, want = _logits(model, ids), _logits(reference, ids)
    assert mx.abs(got - want).max().item() < LOGITS_TOLERANCE
    layers = len(model.model.layers)
    # Per layer and call: one router, two SwiGLUs (routed, shared); 3 calls (8 rows, 1, 1).
    assert calls == {"router": 3 * layers, "swiglu": 6 * layers}, (calls, layers)


def test_model_with_the_moe_order_kernel_keeps_the_bits(tiny_model, goldens):
    """A prompt of 40 tokens sorts its 80 (token, expert) pairs in every MoE: through the
    kernel, the reference's logits bit for bit, one launch per MoE."""
    calls = []

    def counted(*args):
        calls.append(args[0].shape[0])
        return run(*args)

    run = MOE_ORDER.build(sim)
    ids = goldens("tiny").prompt[None, :40].astype(mx.int32)
    assert ids.shape[1] == 40
    model = tiny_model(Kernels(moe_order=counted))
    reference = tiny_model(Kernels(use=False))
    got, want = model(ids, cache=model.make_cache()), reference(ids,
                                                                 cache=reference.make_cache())
    assert mx.array_equal(got, want).item()
    assert calls == [80] * len(model.model.layers), calls


def test_model_on_the_kernels_ops_keeps_the_bits(tiny_model, goldens):
    """The fused path with each kernel's ops in its place (what a failed self-check leaves):
    the reference's logits bit for bit, and the same with the experts' act_fp8 input given."""
    ids = goldens("tiny").prompt[None, :8].astype(mx.int32)
    model = tiny_model(Kernels(router=router_ops, swiglu_act_fp8=swiglu_act_fp8_ops))
    reference = tiny_model(Kernels(use=False))
    assert mx.array_equal(_logits(model, ids), _logits(reference, ids)).item()


def test_moe_takes_its_fp8_input_and_records_from_the_ops(tiny_model):
    """`x_fp8` replaces the MoE's own act_fp8 of x (same bits); with `record` the router is
    the ops' even where its kernel is set, and the recorded picks are the ones used."""
    moe = tiny_model(Kernels(use=False)).model.layers[1].mlp
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((1, 5, 128)).astype(np.float32)).astype(mx.bfloat16)
    with using(Kernels(use=False)):
        x_fp8 = round_act_fp8(x.reshape(-1, 128), mx.float32)
        want = moe(x)
        assert mx.array_equal(moe(x, x_fp8=x_fp8), want).item()
    recorded = {}
    with using(Kernels(router=lambda *args: pytest.fail("router kernel used while recording"))):
        got = moe(x, record=recorded.__setitem__)
    ids, weights = router_ops(x, moe.gate.weight, moe.gate.e_score_correction_bias,
                              moe.gate.bias_vl, None, moe.gate.top_k, moe.gate.route_scale)
    assert mx.array_equal(recorded["gate.indices"], ids.astype(mx.int32)).item()
    assert mx.array_equal(recorded["gate.weights"], weights).item()
    assert mx.array_equal(got, want).item()
