"""Indexer top-k and candidate pool against the reference's own scores (goldens' prefill).

The reference records the scores it handed to top-k (bf16, -inf where invisible or outside the
pool) and what it selected. Feeding those exact scores to our selection functions must reproduce
its choice, except at rows the manifest lists as k-th-place ties, where torch's order is
implementation-defined and ours keeps the lower index (deviations.md D2).
"""

import json

import mlx.core as mx
import numpy as np
import pytest

from mlx_v41.model.indexer import NEG_INF, candidate_pool, top_rows


def _tie_rows(golden, layer: int, kind: str = "index") -> set:
    manifest = json.loads((golden.root / "manifest.json").read_text())
    calls = manifest["prefill"]["index_topk_ties"][kind]["calls"]
    return set(calls.get(f"layers.{layer}.indexer", []))


@pytest.mark.parametrize("name,layer,topk", [("tiny", 2, 16), ("tiny", 9, 16),
                                             ("schedule", 8, 32), ("schedule", 20, 32)])
def test_top_rows_reproduce_reference_selection(goldens, name, layer, topk):
    g = goldens(name)
    scores = g.reference[f"prefill.layers.{layer}.indexer.score"]
    n = g.prompt.shape[0]
    ref = np.array(g.reference[f"prefill.layers.{layer}.indexer.topk"])
    mine = np.array(top_rows(scores[None], topk)[0])
    ties = _tie_rows(g, layer)
    checked = 0
    for row in range(n):
        if row in ties:
            continue
        expected = (ref[row][ref[row] >= n] - n).tolist()
        # Same rows in the same (ascending) order: attention sums them in this order.
        assert mine[row][mine[row] >= 0].tolist() == expected, f"row {row}"
        checked += 1
    assert checked >= n - len(ties) and checked > 100


def test_top_rows_tie_rule_and_empty_picks():
    scores = mx.array([[0.5, 1.0, 1.0, NEG_INF, 1.0]]).astype(mx.bfloat16)
    assert np.array(top_rows(scores, 2))[0].tolist() == [1, 2]           # lower index wins
    picked = np.array(top_rows(scores, 5))[0].tolist()
    assert picked == [0, 1, 2, 4, -1]                   # ascending, -inf becomes a trailing -1
    assert np.array(top_rows(scores, 9)).shape == (1, 5)                 # k capped at T


def test_top_rows_order_does_not_depend_on_unscored_columns():
    """A chunk scores fewer rows than one long call; the picks must come out identically."""
    rng = np.random.default_rng(0)
    scores = mx.array(rng.standard_normal((3, 40)).astype(np.float32)).astype(mx.bfloat16)
    padded = mx.concatenate([scores, mx.full((3, 300), NEG_INF, mx.bfloat16)], axis=-1)
    assert mx.array_equal(top_rows(scores, 16), top_rows(padded, 16))


@pytest.mark.parametrize("name,layer,blocks,block,ratio", [("tiny", 7, 8, 4, 1),
                                                           ("schedule", 20, 8, 8, 1)])
def test_candidate_pool_reproduces_reference(goldens, name, layer, blocks, block, ratio):
    g = goldens(name)
    scores = g.reference[f"prefill.layers.{layer}.indexer.score"]
    expected = np.array(g.reference[f"prefill.layers.{layer}.indexer.candidates"])
    n = scores.shape[0]
    pool = np.array(candidate_pool(scores[None], mx.arange(n), ratio, blocks, block)[0])
    ties = _tie_rows(g, layer, "candidate_blocks")
    bad = [row for row in range(n) if row not in ties and not (pool[row] == expected[row]).all()]
    assert bad == []
    assert (~expected).any(), "the pool must actually restrict some rows in this golden"


def test_fused_head_sum_matches_plain_ops_across_shapes():
    """The indexer's head sum is compiled shapeless (no retrace as the cache grows); its
    broadcast of the per-head weights must stay right when shapes change between calls,
    including calls where the key axis has length 1."""
    from mlx_v41.model.indexer import _weighted_relu_sum

    def plain(qk, w):
        weighted = (mx.maximum(qk.astype(mx.bfloat16), 0) * w).astype(mx.bfloat16)
        return mx.sum(weighted.astype(mx.float32), axis=2).astype(mx.bfloat16)

    rng = np.random.default_rng(3)
    for shape in [(1, 4, 8, 9), (2, 1, 8, 1), (2, 3, 4, 1), (1, 1, 2, 300), (3, 2, 8, 17)]:
        qk = mx.array(rng.standard_normal(shape).astype(np.float32))
        w = mx.array(rng.standard_normal(shape[:3] + (1,)).astype(np.float32)).astype(mx.bfloat16)
        fused = _weighted_relu_sum(qk, w)
        assert fused.shape == shape[:2] + shape[3:]
        assert mx.array_equal(fused, plain(qk, w)), shape
