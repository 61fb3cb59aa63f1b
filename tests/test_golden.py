"""End-to-end parity with the official reference (goldens), in both index-key modes.

How close can a port get? Our forward is bit-identical to the reference until the first
ulp-level difference in an fp32 summation (GEMM, softmax, mHC mixes: different summation orders
than torch's CPU kernels) flips a bf16 rounding. From there the model is chaotic: FP8/FP4
rounding of activations and indexer queries, top-k selection and the Engram signed square root
amplify one bf16 ulp into O(1) logit differences within a few layers. `test_noise_floor` shows
the same amplification inside our own model: a 1e-7 relative change of one mHC weight moves
the logits by O(1). So the tests are:

* exact-regime checks: every position/step before the first such event matches to 2e-2
  (the `grow` golden stays exact for 16 decode steps, `tiny` for its first 7 prefill
  positions: our Sinkhorn sums by `addmm` for speed, which rounds differently from torch's
  `sum` sooner than the plain `mx.sum` did, at 19);
* the D1 switch reproduces the reference's indexer scores bit-exactly (test_index_k_switch);
* whole-run statistics with margins over the measured values (mean |dlogit| 0.27 / 0.66 and
  argmax agreement 0.81 / 0.55 for tiny / schedule prefill) that a real bug breaks: before the
  fp32-input fix for quantized matmuls the tiny prefill had mean 1.05 and argmax 0.30.
"""

import mlx.core as mx
import numpy as np
import pytest

import mlx_v41

MODES = ["fixed", "ref"]
EXACT = 2e-2  # the README's target for a faithful port, where no ulp event has happened yet


def _load(golden, mode):
    return mlx_v41.load_model(golden.hf, compat_reference_index_k_bug=(mode == "ref"))


def _run(golden, mode):
    """Teacher-forced prefill + decode: (prefill logits [N, V], decode logits [M, V])."""
    model = _load(golden, mode)
    cache = model.make_cache()
    prefill = model(golden.prompt[None].astype(mx.int32), cache=cache)[0]
    steps = golden.decode(mode, "input_ids")
    decode = [model(steps[s:s + 1][None].astype(mx.int32), cache=cache)[0, 0]
              for s in range(steps.shape[0])]
    return prefill, mx.stack(decode)


@pytest.fixture(scope="module")
def runs(goldens):
    done = {}

    def get(name, mode):
        if (name, mode) not in done:
            done[(name, mode)] = _run(goldens(name), mode)
        return done[(name, mode)]

    return get


@pytest.mark.parametrize("mode", MODES)
def test_grow_exact_regime(goldens, runs, mode):
    g = goldens("grow")
    prefill, decode = runs("grow", mode)
    assert mx.abs(prefill - g.prefill["logits_all"]).max().item() <= 1e-3
    err = np.array(mx.abs(decode - g.decode(mode, "logits")).max(axis=1))
    assert (err[:16] <= EXACT).all(), err[:16]
    assert (np.array(decode.argmax(-1)) == np.array(g.decode(mode, "argmax")))[:16].all()


def test_tiny_prefill_exact_regime(goldens, runs):
    g = goldens("tiny")
    prefill, _ = runs("tiny", "fixed")
    err = np.array(mx.abs(prefill - g.prefill["logits_all"]).max(axis=1))
    assert (err[:7] <= EXACT).all(), err[:7]


@pytest.mark.parametrize("name,mean_bound,argmax_bound", [("tiny", 0.45, 0.7),
                                                          ("schedule", 1.0, 0.45)])
def test_prefill_statistics(goldens, runs, name, mean_bound, argmax_bound):
    g = goldens(name)
    prefill, _ = runs(name, "fixed")
    ref = g.prefill["logits_all"]
    assert mx.abs(prefill - ref).mean().item() <= mean_bound
    agree = (np.array(prefill.argmax(-1)) == np.array(ref.argmax(-1))).mean()
    assert agree >= argmax_bound


@pytest.mark.parametrize("name,mode,min_agree", [("tiny", "fixed", 28), ("tiny", "ref", 28),
                                                 ("grow", "fixed", 45), ("grow", "ref", 44),
                                                 ("schedule", "fixed", 14),
                                                 ("schedule", "ref", 9)])
def test_decode_argmax_agreement(goldens, runs, name, mode, min_agree):
    g = goldens(name)
    _, decode = runs(name, mode)
    agree = (np.array(decode.argmax(-1)) == np.array(g.decode(mode, "argmax"))).sum()
    assert agree >= min_agree


@pytest.mark.parametrize("mode", MODES)
def test_free_running_greedy_grow(goldens, mode):
    """Free-running greedy decode follows the reference's token sequence through the exact
    regime (measured: 24 tokens)."""
    g = goldens("grow")
    model = _load(g, mode)
    cache = model.make_cache()
    token = model(g.prompt[None].astype(mx.int32), cache=cache, last_only=True)[0, -1].argmax()
    expected = np.array(g.decode(mode, "input_ids")).tolist()
    produced = []
    for _ in range(20):
        produced.append(token.item())
        token = model(token.reshape(1, 1).astype(mx.int32), cache=cache)[0, -1].argmax()
    assert produced == expected[:20]


def test_index_k_switch(goldens):
    """D1: at even decode positions the reference scores ratio-2 indexers against the ratio-1
    owner's keys. Our default uses the layer's own keys; the switch reproduces the reference.
    Scores are compared bit-exactly in the exact regime of `grow` (steps 0-3)."""
    g = goldens("grow")
    for mode, other in (("fixed", "ref"), ("ref", "fixed")):
        model = _load(g, mode)
        cache = model.make_cache()
        model(g.prompt[None].astype(mx.int32), cache=cache)
        steps = g.decode(mode, "input_ids")
        for s in range(4):
            captured = {}
            model(steps[s:s + 1][None].astype(mx.int32), cache=cache, capture=captured)
            for layer in (2, 5):
                key = f"layers.{layer}.indexer.score"
                mine = captured[key][0].astype(mx.float32)
                finite = mx.isfinite(g.step(mode, s, key).astype(mx.float32))
                same = mx.where(finite, mine == g.step(mode, s, key).astype(mx.float32), True)
                assert same.all().item(), (mode, s, layer)
                differs = mx.where(finite, mine != g.step(other, s, key).astype(mx.float32),
                                   False).any().item()
                assert differs == (s % 2 == 1), (mode, s, layer)  # positions 6 and 8 are even


def test_noise_floor(goldens):
    """A 1e-7 relative change of one layer's mHC weights moves our own logits by O(1): the
    reason the whole-run tolerances above cannot be 1e-2."""
    g = goldens("tiny")
    ids = g.prompt[None].astype(mx.int32)
    model = mlx_v41.load_model(g.hf)
    base = model(ids)
    model.model.layers[3].attn_hc.fn = model.model.layers[3].attn_hc.fn * (1 + 1e-7)
    drift = mx.abs(model(ids) - base).max().item()
    assert drift > 0.1
