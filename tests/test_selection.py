"""The indexer's selection functions the attention layers call (`visible_rows`, `top_rows`,
`candidate_blocks`, `expand_blocks`) against hand-built cases and the reference's own records.

The goldens hold the scores the reference handed to top-k (bf16, -inf where invisible or outside
the pool), what it selected and the candidate pool it built. Our functions fed those exact
scores must reproduce its choices, except at rows the manifest lists as k-th-place ties, where
torch's order is implementation-defined and ours keeps the lower index.
Integer and boolean results, exact on any backend; the fused head sum is compared on the CPU
backend (the `cpu` fixture), where its fp32 sums are exact for the chosen inputs.
"""

import json

import mlx.core as mx
import numpy as np
import pytest

from mlx_v41.model.indexer import (NEG_INF, _weighted_relu_sum, candidate_blocks, expand_blocks,
                                   top_rows, visible_rows)

pytestmark = pytest.mark.usefixtures("cpu")

# (golden, candidate source layer, Reindex layer with recorded scores or None)
POOLS = [("tiny", 7, 9), ("schedule", 20, None)]


def _tie_rows(golden, layer: int, kind: str = "index") -> set:
    manifest = json.loads((golden.root / "manifest.json").read_text())
    calls = manifest["prefill"]["index_topk_ties"][kind]["calls"]
    return set(calls.get(f"layers.{layer}.indexer", []))


def _finite(scores: mx.array) -> np.ndarray:
    return np.isfinite(np.array(scores.astype(mx.float32)))


def _pool(golden, source: int) -> np.ndarray:
    """Our pool mask [N, T] from the reference's recorded candidate-source scores."""
    cfg = json.loads((golden.hf / "config.json").read_text())["text_config"]
    scores = golden.reference[f"prefill.layers.{source}.indexer.score"]
    n, block = scores.shape[0], cfg["candidate_block_size"]
    member = candidate_blocks(scores[None], mx.arange(n), cfg["compress_ratios"][source],
                              cfg["candidate_topk_blocks"], block)
    return np.array(expand_blocks(member, block, scores.shape[-1])[0])


# ---------------------------------------------------------------- visible_rows

def test_visible_rows_by_hand():
    """Row t (the group of positions [t*m, (t+1)*m)) is visible once the group is complete."""
    expected = [[0, 0, 0], [1, 0, 0], [1, 0, 0], [1, 1, 0], [1, 1, 0], [1, 1, 1]]
    assert np.array(visible_rows(mx.arange(6), 2, 3)).astype(int).tolist() == expected
    # A decode chunk at positions 9 and 10, ratio 4: groups 0 and 1 are complete.
    assert np.array(visible_rows(mx.array([9, 10]), 4, 3)).astype(int).tolist() == [[1, 1, 0]] * 2
    assert np.array(visible_rows(mx.arange(3), 1, 3)).astype(int).tolist() == \
        [[1, 0, 0], [1, 1, 0], [1, 1, 1]]


@pytest.mark.parametrize("name,layer,ratio", [("tiny", 2, 2), ("tiny", 7, 1),
                                              ("schedule", 8, 2), ("schedule", 20, 1)])
def test_visible_rows_are_where_the_reference_scored(goldens, name, layer, ratio):
    g = goldens(name)
    scores = g.reference[f"prefill.layers.{layer}.indexer.score"]
    n, total = scores.shape
    assert np.array_equal(np.array(visible_rows(mx.arange(n), ratio, total)), _finite(scores))


# ---------------------------------------------------------------- top_rows

@pytest.mark.parametrize("name,layer,topk", [("tiny", 2, 16), ("tiny", 7, 16), ("tiny", 9, 16),
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
        expected = (ref[row][ref[row] >= n] - n).tolist()  # reference ids: [N window; rows]
        # Same rows in the same (ascending) order: attention sums them in this order.
        assert mine[row][mine[row] >= 0].tolist() == expected, f"row {row}"
        checked += 1
    assert checked == n - len(ties) and checked > 100


def test_top_rows_tie_rule_and_empty_picks():
    scores = mx.array([[0.5, 1.0, 1.0, NEG_INF, 1.0]]).astype(mx.bfloat16)
    assert np.array(top_rows(scores, 2))[0].tolist() == [1, 2]           # lower index wins
    picked = np.array(top_rows(scores, 5))[0].tolist()
    assert picked == [0, 1, 2, 4, -1]                   # ascending, -inf becomes a trailing -1
    assert np.array(top_rows(scores, 9)).shape == (1, 5)                 # k capped at T
    assert np.array(top_rows(scores, 0)).shape == (1, 0)


def test_top_rows_order_does_not_depend_on_unscored_columns():
    """A chunk scores fewer rows than one long call; the picks must come out identically."""
    rng = np.random.default_rng(0)
    scores = mx.array(rng.standard_normal((3, 40)).astype(np.float32)).astype(mx.bfloat16)
    padded = mx.concatenate([scores, mx.full((3, 300), NEG_INF, mx.bfloat16)], axis=-1)
    assert mx.array_equal(top_rows(scores, 16), top_rows(padded, 16))


# ---------------------------------------------------------------- candidate pool

def test_candidate_blocks_by_hand():
    """Blocks of 2 rows; the block holding the newest visible row is always kept; the others
    by their best score (ties to the lower block); a block with nothing visible never is."""
    inf = NEG_INF
    rows = mx.array([[[0.5, 3.0, -1.0, 0.25, 2.0, 1.0, -2.0],     # position 6: newest block 3
                      [0.5, 3.0, -1.0, 0.25, inf, inf, inf],      # position 3: newest block 1
                      [2.0, 1.0, 0.0, 0.0, 2.0, 1.0, -2.0]]])     # position 6, b0 ties b2
    positions = mx.array([6, 3, 6])

    def member(n_blocks):
        out = candidate_blocks(rows, positions, 1, n_blocks, 2)
        return np.array(out[0]).astype(int).tolist()

    assert member(2) == [[1, 0, 0, 1], [1, 1, 0, 0], [1, 0, 0, 1]]
    assert member(3) == [[1, 0, 1, 1], [1, 1, 0, 0], [1, 0, 1, 1]]
    # Ratio 2, 3 compressed rows: position 0 has no complete group (nothing visible, nothing
    # pinned); position 3 has two, both in block 0.
    ratio2 = mx.array([[[inf, inf, inf], [1.0, 2.0, inf]]])
    out = candidate_blocks(ratio2, mx.array([0, 3]), 2, 1, 2)
    assert np.array(out[0]).astype(int).tolist() == [[0, 0], [1, 0]]


def test_expand_blocks_by_hand():
    member = mx.array([[[True, False, True]]])
    assert np.array(expand_blocks(member, 2, 5))[0, 0].astype(int).tolist() == [1, 1, 0, 0, 1]
    assert np.array(expand_blocks(member, 2, 6))[0, 0].astype(int).tolist() == [1, 1, 0, 0, 1, 1]
    assert np.array(expand_blocks(member, 3, 7))[0, 0].astype(int).tolist() == \
        [1, 1, 1, 0, 0, 0, 1]


@pytest.mark.parametrize("name,source,_", POOLS)
def test_candidate_pool_reproduces_reference(goldens, name, source, _):
    g = goldens(name)
    expected = np.array(g.reference[f"prefill.layers.{source}.indexer.candidates"])
    pool = _pool(g, source)
    ties = _tie_rows(g, source, "candidate_blocks")
    bad = [row for row in range(len(pool))
           if row not in ties and not (pool[row] == expected[row]).all()]
    assert bad == []
    assert (~expected).any(), "the pool must actually restrict some rows in this golden"


@pytest.mark.parametrize("name,source,reindex", [p for p in POOLS if p[2] is not None])
def test_reindex_layer_scores_exactly_the_visible_pool(goldens, name, source, reindex):
    """What a Reindex layer hands to top-k is visible_rows AND the source's pool, row by row:
    the reference's recorded scores are finite exactly there."""
    g = goldens(name)
    scores = g.reference[f"prefill.layers.{reindex}.indexer.score"]
    n, total = scores.shape
    allowed = np.array(visible_rows(mx.arange(n), 1, total)) & _pool(g, source)
    ties = _tie_rows(g, source, "candidate_blocks")
    finite = _finite(scores)
    bad = [row for row in range(n) if row not in ties and not (finite[row] == allowed[row]).all()]
    assert bad == []
    restricted = (allowed.sum(1) < np.array(visible_rows(mx.arange(n), 1, total)).sum(1)).sum()
    assert restricted > n // 2  # most rows see fewer rows than they could without the pool


# ---------------------------------------------------------------- fused head sum

def _bf16(x: np.ndarray) -> np.ndarray:
    """Round to bf16 (nearest, ties to even), as float32."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def test_fused_head_sum_against_numpy_across_shapes():
    """Σ_heads bf16(relu(bf16(qk)) · w), summed in fp32, as bf16; the function is compiled
    shapeless (no retrace as the cache grows), so its broadcast of the per-head weights must
    stay right when shapes change between calls, including a key axis of length 1. Inputs keep
    every product within 2^-3..2^3, so any fp32 summation order is exact and numpy's float64
    sum is the expectation."""
    rng = np.random.default_rng(3)
    for shape in [(1, 4, 8, 9), (2, 1, 8, 1), (2, 3, 4, 1), (1, 1, 2, 300), (3, 2, 8, 17)]:
        qk = rng.choice([-1, 1], shape) * rng.uniform(0.5, 4.0, shape)
        w = _bf16(rng.choice([-1, 1], shape[:3] + (1,)) * rng.uniform(0.25, 2.0, shape[:3] + (1,)))
        products = _bf16(np.maximum(_bf16(qk), 0) * w)
        expected = _bf16(products.astype(np.float64).sum(axis=2))
        fused = _weighted_relu_sum(mx.array(qk.astype(np.float32)),
                                   mx.array(w).astype(mx.bfloat16))
        assert fused.shape == shape[:2] + shape[3:] and fused.dtype == mx.bfloat16
        assert np.array_equal(np.array(fused.astype(mx.float32)), expected), shape


def test_one_head_scores_match_numpy_with_evaluated_inputs():
    """One index head (as small test configs have): `block_scores` skips the head sum, which
    MLX 0.32 crashes on (a segfault summing a size-1 axis in a shapeless compile, once the
    inputs are evaluated), and keeps its bits: 0 + x, so -0 scores come out +0."""
    from mlx_v41.model.indexer import Indexer

    rng = np.random.default_rng(4)
    indexer = Indexer(64, 32, 64, 1, 16, False, 1e-6)
    for s, t in [(63, 31), (1, 5), (4, 1)]:
        q = mx.array(_bf16(rng.uniform(-2, 2, (1, s, 1, 16)))).astype(mx.bfloat16)
        keys = mx.array(_bf16(rng.uniform(-2, 2, (1, t, 16)))).astype(mx.bfloat16)
        w = mx.array(_bf16(rng.choice([-1, 1], (1, s, 1, 1)) * 0.5)).astype(mx.bfloat16)
        mx.eval(q, keys, w)
        got = indexer.block_scores(q, w, keys)
        qk = np.array(mx.einsum("bshd,btd->bsht", q, keys).astype(mx.float32))
        expected = _bf16(_bf16(np.maximum(_bf16(qk), 0) * np.array(w.astype(mx.float32))) + 0.0)
        assert got.shape == (1, s, t) and got.dtype == mx.bfloat16
        got32 = np.array(got.astype(mx.float32))
        assert np.array_equal(got32.view(np.uint32), expected[:, :, 0].view(np.uint32)), (s, t)
        assert (got32 == 0).any() and not np.signbit(got32[got32 == 0]).any()
