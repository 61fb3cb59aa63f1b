"""Speculative sampling is distributed as plain sampling, end to end on a model: the joint
distribution of the first three tokens of seeded DSpark runs (temperature 1, top-p 0.9) against
the exact joint computed from plain forwards, by a chi-square bound; the same runs with a
deliberately wrong rejection rule (draw the replacement from the target instead of the residual,
a classic speculative-sampling bug) fail the bound: the test of the test."""

import mlx.core as mx
import numpy as np
import pytest

import mlx_v41
from mlx_v41.cache.persistence import copy_cache
from mlx_v41.checkpoint.random_checkpoint import tiny_text_config
from mlx_v41.generation import speculative
from mlx_v41.generation.api import prefill
from mlx_v41.generation.speculative import Sampling, speculative_steps
from checkpoint_factory import write_checkpoint

pytestmark = pytest.mark.usefixtures("cpu")

VOCAB = 8  # small enough that the three-token joint has 512 cells
PROMPT = [1, 2, 3, 4, 5]
TOP_P = 0.9
MIN_EXPECTED = 5.0  # cells expected fewer times than this are pooled into one
Z_P001 = 3.0902  # standard normal quantile at 1 - 0.001


def chi2_bound(df: int) -> float:
    """Chi-square quantile at p = 0.001 (Wilson-Hilferty; within 1 % for df >= 10)."""
    a = 2.0 / (9 * df)
    return df * (1 - a + Z_P001 * a ** 0.5) ** 3


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """4 + 3 layers over an 8-token vocabulary: peaked distributions, fast cycles."""
    cfg = tiny_text_config(
        num_hidden_layers=4, compress_ratios=[0, 2, 1, 0, 0, 0, 0], kv_source_layer_ids=[1, 2],
        index_source_layer_ids=[1, 2], candidate_source_layer_id=2,
        dspark_target_layer_ids=[1, 2, 3], vocab_size=VOCAB, dspark_noise_token_id=VOCAB - 1,
        hidden_size=64, n_routed_experts=4, dspark_n_routed_experts=2, moe_intermediate_size=32)
    # Seed 2: a drafter far enough from the target that a wrong rule shows in 500 runs.
    folder = write_checkpoint(tmp_path_factory.mktemp("small"), cfg, engram=False, seed=2)
    return mlx_v41.load_model(folder, prefill_mode="full")


def nucleus(logits: np.ndarray) -> np.ndarray:
    """Temperature 1, top-p TOP_P, written out independently of the code under test: keep
    the most likely tokens until their mass reaches TOP_P (the one crossing it included)."""
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    order = np.argsort(-p, axis=-1)
    ranked = np.take_along_axis(p, order, -1)
    before = np.cumsum(ranked, -1) - ranked          # mass of the more likely tokens
    keep = np.zeros_like(p, dtype=bool)
    np.put_along_axis(keep, order, before < TOP_P, -1)
    p = np.where(keep, p, 0.0)
    return p / p.sum(-1, keepdims=True)


def plain_joint(model) -> np.ndarray:
    """P(t1, t2, t3) of plain sampling, from full forwards over every two-token prefix."""
    def last(rows):
        return np.array(model(mx.array(rows, dtype=mx.int32))[:, -1].astype(mx.float32))

    first = nucleus(last([PROMPT]))[0]                                       # [V]
    second = nucleus(last([PROMPT + [a] for a in range(VOCAB)]))             # [V, V]
    pairs = [PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)]
    third = nucleus(last(pairs)).reshape(VOCAB, VOCAB, VOCAB)
    return first[:, None, None] * second[:, :, None] * third


def speculative_joint(model, runs: int, seed: int) -> np.ndarray:
    """Counts of the first three tokens of `runs` DSpark runs (2 drafts per cycle)."""
    cache = model.make_cache()
    logits = prefill(model, PROMPT, cache)
    counts = np.zeros((VOCAB,) * 3)
    mx.random.seed(seed)
    for _ in range(runs):
        run = copy_cache(cache)
        tokens = [t for t, _, _ in speculative_steps(
            model, logits, run, sampling=Sampling(temp=1.0, top_p=TOP_P), max_tokens=3,
            num_draft_tokens=2)]
        counts[tuple(tokens)] += 1
    return counts


def chi2(counts: np.ndarray, p: np.ndarray) -> tuple:
    """(statistic, degrees of freedom) with cells of small expectation pooled."""
    expected = counts.sum() * p.ravel()
    observed = counts.ravel()
    big = expected >= MIN_EXPECTED
    assert not observed[expected == 0].any(), "drew a sequence plain sampling never draws"
    e = np.append(expected[big], expected[~big].sum())
    o = np.append(observed[big], observed[~big].sum())
    o, e = o[e > 0], e[e > 0]
    return float(((o - e) ** 2 / e).sum()), len(e) - 1


def wrong_accept(sampling, targets, drafts, q, key=None):
    """The acceptance test of `_accept`, but a rejection draws from p, not from the residual
    max(p - q, 0): the drafts' mass is counted twice."""
    p = mx.exp(sampling.logprobs(targets))
    for r, token in enumerate(drafts):
        if mx.random.uniform().item() >= min(1.0, (p[r, token] / mx.exp(q[r, token])).item()):
            return drafts[:r], mx.random.categorical(mx.log(p[r])).item()
    return drafts, mx.random.categorical(mx.log(p[len(drafts)])).item()


@pytest.mark.slow
def test_speculative_joint_matches_plain_sampling(small, monkeypatch):
    """300 seeded runs each. Measured: 10.0 for the exact rule and 52.3 for the wrong one,
    against the bound 31.4 (11 degrees of freedom after pooling)."""
    p = plain_joint(small)
    stat, df = chi2(speculative_joint(small, 300, seed=0), p)
    assert stat < chi2_bound(df), (stat, df)
    monkeypatch.setattr(speculative, "_accept", wrong_accept)
    stat, df = chi2(speculative_joint(small, 300, seed=0), p)
    assert stat > chi2_bound(df), (stat, df)
