"""The indexer's selection blocked over keys as well as query rows (model/selection.py): a
running top-k over key blocks selects exactly what one top-k over all scores selects, and a
prefill chunk adds no evaluation of its own however long the context (a 1M-token prompt must
not run one `mx.eval` per query row or per key block). CPU backend (the `cpu` fixture)."""

import mlx.core as mx
import numpy as np
import pytest

from conftest import slow
from mlx_v41.model.indexer import sort_key, top_rows
from mlx_v41.model.selection import _merge, finish

pytestmark = pytest.mark.usefixtures("cpu")


def _running(scores: mx.array, k: int, block: int) -> mx.array:
    best = None
    for start in range(0, scores.shape[-1], block):
        best = _merge(best, sort_key(scores[..., start:start + block], start), k)
    return finish(best, scores.shape[-1])


@pytest.mark.parametrize("k,block", [(4, 3), (16, 5), (7, 64), (40, 8)])
def test_running_top_k_equals_one_top_k(k, block):
    """Ties (scores drawn from 6 values), -inf rows and k above the visible count: the
    blockwise merge keeps the same rows in the same order, -1 for -inf picks."""
    rng = np.random.default_rng(k)
    values = rng.choice([-2.0, -0.5, 0.0, 0.5, 1.0, 3.0], (2, 5, 37)).astype(np.float32)
    values[rng.random(values.shape) < 0.3] = -np.inf
    scores = mx.array(values).astype(mx.bfloat16)
    assert mx.array_equal(_running(scores, k, block), top_rows(scores, k))


def _evaluations(model, ids, monkeypatch) -> tuple:
    """(mx.eval calls, NumPy Sinkhorns) of a chunked prefill of `ids` (chunks of 8), from an
    empty cache."""
    import mlx_v41.numerics.mhc as mhc

    calls, host = [], []
    real, real_host = mx.eval, mhc.sinkhorn_host
    monkeypatch.setattr(mx, "eval", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    monkeypatch.setattr(mhc, "sinkhorn_host", lambda *a: (host.append(1), real_host(*a))[1])
    model.prefill(ids, model.make_cache(), step_size=8)
    monkeypatch.setattr(mx, "eval", real)
    monkeypatch.setattr(mhc, "sinkhorn_host", real_host)
    return len(calls), len(host)


@pytest.mark.parametrize("host_sinkhorn", [False, slow(True)])
@pytest.mark.slow
def test_one_evaluation_per_chunk_at_any_context(tiny_ops, goldens, monkeypatch, host_sinkhorn):
    """Key blocks of 8 rows and one query row per score block: 3 chunks and 11 chunks of 8
    tokens evaluate exactly once per chunk (the chunk's own evaluation), the last chunk of
    the longer prompt scoring 11 key blocks per index layer. A first run makes the constants
    that are evaluated once per shape (row numbers, tables). With the CPU's NumPy Sinkhorn
    (chunks this small use it) each block side that runs adds its one evaluation: at most
    2 per layer in every chunk, whatever the context (exact CED runs the decoder layers in
    some chunks only)."""
    import mlx_v41.model.attention as attention
    import mlx_v41.model.indexer as indexer

    monkeypatch.setattr(indexer, "KEY_BLOCK", 8)
    monkeypatch.setattr(attention, "SCORE_BLOCK_ELEMENTS", 1)
    monkeypatch.setattr(tiny_ops.kernels, "host_sinkhorn", host_sinkhorn)
    prompt = goldens("tiny").prompt[None].astype(mx.int32)
    assert prompt.shape[1] >= 88
    for length in (24, 88):
        _evaluations(tiny_ops, prompt[:, :length], monkeypatch)
        evaluations, host = _evaluations(tiny_ops, prompt[:, :length], monkeypatch)
        assert evaluations - host == length // 8
        sides = 2 * tiny_ops.cfg.num_hidden_layers * (length // 8)
        assert (sides // 2 < host <= sides) if host_sinkhorn else host == 0, (host, sides)


@pytest.mark.slow
def test_blocked_prefill_equals_unblocked_at_the_last_chunk(tiny_ops, goldens, monkeypatch):
    """The same prompt, selections blocked over 8-row key blocks (several per layer, so the
    running top-k drops earlier picks) or in one block: identical logits."""
    import mlx_v41.model.indexer as indexer

    prompt = goldens("tiny").prompt[None, :88].astype(mx.int32)
    whole = tiny_ops.prefill(prompt, tiny_ops.make_cache(), step_size=8)
    monkeypatch.setattr(indexer, "KEY_BLOCK", 8)
    blocked = tiny_ops.prefill(prompt, tiny_ops.make_cache(), step_size=8)
    assert mx.array_equal(blocked, whole)
