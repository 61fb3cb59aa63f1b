"""Invariants of the forward pass: chunked prefill/decode with the cache equals one call over
the whole sequence (ragged random splits, including single tokens and splits inside a ratio-2
group), and a batch of 2 equals two batches of 1. Exact on MLX's CPU backend, whose kernels sum
identically across these shapes: the module runs there (the `cpu` fixture) on the reference ops.
Metal's GEMMs and reductions make no such promise."""

import random

import mlx.core as mx
import pytest

from conftest import slow

pytestmark = pytest.mark.usefixtures("cpu")


@pytest.fixture(scope="module")
def prompt(goldens):
    return goldens("tiny").prompt[None, :90].astype(mx.int32)


def _chunked(model, ids, splits):
    cache = model.make_cache()
    outs, previous = [], 0
    for end in list(splits) + [ids.shape[1]]:
        outs.append(model(ids[:, previous:end], cache=cache))
        previous = end
    return mx.concatenate(outs, axis=1), cache


@pytest.mark.parametrize("seed", [0, slow(1), slow(2), slow(3)])
def test_cached_equals_uncached_over_random_splits(tiny_ops, prompt, seed):
    rng = random.Random(seed)
    n = prompt.shape[1]
    splits = sorted(rng.sample(range(1, n), rng.randint(1, 8)))
    full = tiny_ops(prompt)
    chunked, cache = _chunked(tiny_ops, prompt, splits)
    assert mx.array_equal(chunked, full), splits
    assert all(c.offset == n for c in cache)


@pytest.mark.parametrize("step", [slow(7), 13])
@pytest.mark.slow
def test_fixed_step_chunks_over_the_whole_prompt(tiny_ops, goldens, step):
    """Chunks of 7 once made the top-k come out in another order than one call (argpartition
    order depends on how many rows are scored), which changed attention's summation order."""
    ids = goldens("tiny").prompt[None].astype(mx.int32)
    chunked, _ = _chunked(tiny_ops, ids, range(step, ids.shape[1], step))
    assert mx.array_equal(chunked, tiny_ops(ids))


@pytest.mark.slow
def test_token_by_token_equals_prefill(tiny_ops, prompt):
    ids = prompt[:, :40]
    chunked, _ = _chunked(tiny_ops, ids, range(1, 40))
    assert mx.array_equal(chunked, tiny_ops(ids))


@pytest.mark.slow
def test_batch_of_two_equals_two_batches_of_one(tiny_ops, prompt):
    other = prompt[:, ::-1]
    both = tiny_ops(mx.concatenate([prompt, other], axis=0))
    assert mx.array_equal(both[0], tiny_ops(prompt)[0])
    assert mx.array_equal(both[1], tiny_ops(other)[0])


def test_batched_decode_continues_each_row(tiny_ops, prompt):
    batch = mx.concatenate([prompt[:, :50], prompt[:, 10:60]], axis=0)
    cache = tiny_ops.make_cache()
    tiny_ops(batch, cache=cache)
    step = tiny_ops(mx.array([[5], [7]], dtype=mx.int32), cache=cache)
    for row, ids in enumerate([prompt[:, :50], prompt[:, 10:60]]):
        single = tiny_ops.make_cache()
        tiny_ops(ids, cache=single)
        token = mx.array([[5, 7][row]], dtype=mx.int32)[None]
        assert mx.array_equal(step[row], tiny_ops(token, cache=single)[0])


def test_last_only_matches_full_logits(tiny_ops, prompt):
    assert mx.array_equal(tiny_ops(prompt, last_only=True)[:, -1], tiny_ops(prompt)[:, -1])


@pytest.mark.slow
def test_selection_in_row_blocks_is_exact(tiny_ops, prompt, monkeypatch):
    """The indexer scores and selects query rows in blocks and decodes the packed index keys
    in blocks of rows (bounded memory at long contexts); one query row per block and key
    blocks of 3 rows must give the same scores, selections, pool and logits as one block."""
    import mlx_v41.model.attention as attention
    import mlx_v41.model.indexer as indexer

    whole = {}
    logits = tiny_ops(prompt, capture=whole)
    monkeypatch.setattr(attention, "SCORE_BLOCK_ELEMENTS", 1)
    monkeypatch.setattr(indexer, "KEY_BLOCK", 3)
    blocked = {}
    assert mx.array_equal(tiny_ops(prompt, capture=blocked), logits)
    assert mx.array_equal(tiny_ops(prompt), logits)
    assert mx.array_equal(tiny_ops.prefill(prompt), logits[:, -1:])  # the CED halo, blocked too
    names = [k for k in whole if ".indexer." in k]
    assert any(k.startswith("layers.9.") for k in names)  # a Reindex layer (candidate pool)
    for name in names:
        assert mx.array_equal(blocked[name], whole[name]), name
