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
  fp32-input fix for quantized matmuls the tiny prefill had mean 1.05 and argmax 0.30;
* the Reindex layers' selections: every row inside the candidate pool (exact), and their
  overlap with the reference's (chaotic beyond the exact regime, so a mean with a margin).

The reference ran on torch's CPU kernels and the exact regimes above were measured on MLX's
CPU backend, so the module runs there (the `cpu` fixture), on the reference ops.
"""

from typing import NamedTuple

import mlx.core as mx
import numpy as np
import pytest

import mlx_v41
from conftest import reference_ops, slow
from mlx_v41.model.indexer import candidate_blocks, expand_blocks
from mlx_v41.model.schedule import REINDEX

pytestmark = pytest.mark.usefixtures("cpu")

MODES = ["fixed", "ref"]
EXACT = 2e-2  # the README's target for a faithful port, where no ulp event has happened yet


def _load(golden, mode):
    return reference_ops(mlx_v41.load_model(golden.hf,
                                            compat_reference_index_k_bug=(mode == "ref")))


class Run(NamedTuple):
    prefill: mx.array     # logits [N, V]
    decode: mx.array      # logits [M, V]
    captured: dict        # the prefill's intermediates, named like the goldens'
    model: object


def _run(golden, mode) -> Run:
    """Teacher-forced prefill + decode."""
    model = _load(golden, mode)
    cache, captured = model.make_cache(), {}
    prefill = model(golden.prompt[None].astype(mx.int32), cache=cache, capture=captured)[0]
    steps = golden.decode(mode, "input_ids")
    decode = [model(steps[s:s + 1][None].astype(mx.int32), cache=cache)[0, 0]
              for s in range(steps.shape[0])]
    return Run(prefill, mx.stack(decode), captured, model)


@pytest.fixture(scope="module")
def runs(goldens):
    done = {}

    def get(name, mode):
        if (name, mode) not in done:
            done[(name, mode)] = _run(goldens(name), mode)
        return done[(name, mode)]

    return get


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.slow
def test_grow_exact_regime(goldens, runs, mode):
    g = goldens("grow")
    prefill, decode = runs("grow", mode)[:2]
    assert mx.abs(prefill - g.prefill["logits_all"]).max().item() <= 1e-3
    err = np.array(mx.abs(decode - g.decode(mode, "logits")).max(axis=1))
    assert (err[:16] <= EXACT).all(), err[:16]
    assert (np.array(decode.argmax(-1)) == np.array(g.decode(mode, "argmax")))[:16].all()


@pytest.mark.slow
def test_tiny_prefill_exact_regime(goldens, runs):
    g = goldens("tiny")
    prefill = runs("tiny", "fixed").prefill
    err = np.array(mx.abs(prefill - g.prefill["logits_all"]).max(axis=1))
    assert (err[:7] <= EXACT).all(), err[:7]


# The schedule golden's cases are slow: its 40-layer run (prefill + decode, each mode) takes
# seconds; the tiny and grow goldens run the same code in the fast lane.
@pytest.mark.parametrize("name,mean_bound,argmax_bound", [("tiny", 0.45, 0.7),
                                                          slow("schedule", 1.0, 0.45)])
def test_prefill_statistics(goldens, runs, name, mean_bound, argmax_bound):
    g = goldens(name)
    prefill = runs(name, "fixed").prefill
    ref = g.prefill["logits_all"]
    assert mx.abs(prefill - ref).mean().item() <= mean_bound
    agree = (np.array(prefill.argmax(-1)) == np.array(ref.argmax(-1))).mean()
    assert agree >= argmax_bound


# Measured agreements (of 40 / 60 / 32 steps): tiny 29 / 28, grow 53 / 49, schedule 21 / 14
# (fixed / ref); the bounds leave about a tenth of the steps as margin.
@pytest.mark.parametrize("name,mode,min_agree", [("tiny", "fixed", 25), ("tiny", "ref", 24),
                                                 ("grow", "fixed", 47), ("grow", "ref", 43),
                                                 slow("schedule", "fixed", 17),
                                                 slow("schedule", "ref", 10)])
@pytest.mark.slow
def test_decode_argmax_agreement(goldens, runs, name, mode, min_agree):
    g = goldens(name)
    decode = runs(name, mode).decode
    agree = (np.array(decode.argmax(-1)) == np.array(g.decode(mode, "argmax"))).sum()
    assert agree >= min_agree


def _picked(topk: np.ndarray, window: int = 0) -> list:
    """Per row, the set of selected compressed rows (-1 empty; the reference's ids count
    `window` window rows first)."""
    return [set((row[row >= window] - window).tolist()) for row in topk]


# Mean overlap of the selected rows with the reference's, measured per Reindex layer: tiny 0.81
# / 0.80 (layers 9 / 11), schedule 0.69 / 0.69 / 0.68 / 0.68 (24 / 28 / 32 / 36). Without the
# candidate-pool restriction: 0.44 / 0.42 and 0.50 / 0.50 / 0.49 / 0.48.
@pytest.mark.parametrize("name,min_overlap", [("tiny", 0.65), slow("schedule", 0.59)])
def test_reindex_selections(goldens, runs, name, min_overlap):
    """Every row a Reindex layer selects lies in the candidate pool built from this run's own
    candidate-source scores (exact); and per layer, the mean fraction of the reference's
    selected rows that ours selects too (tie rows included: they are within the margin)."""
    g = goldens(name)
    captured, model = runs(name, "fixed")[2:]
    n, cfg = g.prompt.shape[0], model.cfg
    source = next(r for r in model.roles if r.is_candidate_source)
    member = candidate_blocks(captured[f"layers.{source.layer}.indexer.score"], mx.arange(n),
                              source.ratio, cfg.candidate_topk_blocks, cfg.candidate_block_size)
    pool = np.array(expand_blocks(member, cfg.candidate_block_size, n)[0])
    reindex = [r.layer for r in model.roles if r.mode == REINDEX]
    assert len(reindex) >= 2 and all(layer > source.layer for layer in reindex)
    for layer in reindex:
        mine = _picked(np.array(captured[f"layers.{layer}.indexer.topk"][0]))
        outside = sum(not pool[row, i] for row in range(n) for i in mine[row])
        assert outside == 0, (layer, outside)
        ref = _picked(np.array(g.reference[f"prefill.layers.{layer}.indexer.topk"]), n)
        overlap = np.mean([len(a & b) / len(b) for a, b in zip(mine, ref) if b])
        assert overlap >= min_overlap, (layer, overlap)


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


@pytest.mark.slow
def test_noise_floor(goldens):
    """A 1e-7 relative change of one layer's mHC weights moves our own logits by O(1): the
    reason the whole-run tolerances above cannot be 1e-2."""
    g = goldens("tiny")
    ids = g.prompt[None].astype(mx.int32)
    model = reference_ops(mlx_v41.load_model(g.hf))
    base = model(ids)
    model.model.layers[3].attn_hc.fn = model.model.layers[3].attn_hc.fn * (1 + 1e-7)
    drift = mx.abs(model(ids) - base).max().item()
    assert drift > 0.1
