"""One sequence state: atomic calls, trims that report what they can do (ours and mlx-lm's
helpers), clear errors for input a forward cannot run, input embeddings and taps."""

import warnings

import mlx.core as mx
import pytest
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

import mlx_v41
from mlx_v41 import CacheError, trim_cache
from mlx_v41.cache.layer import commit
from mlx_v41.generation.api import prefill
from mlx_v41.model.config import ModelArgs
from mlx_v41.model.model import Model
from conftest import golden_checkpoint

# Exact equalities between different computations: they hold on the CPU backend.
pytestmark = pytest.mark.usefixtures("cpu")


@pytest.fixture(scope="module")
def prompt(goldens):
    return goldens("tiny").prompt[None].astype(mx.int32)


@pytest.fixture(scope="module")
def models():
    return {mode: mlx_v41.load_model(golden_checkpoint("tiny"), prefill_mode=mode)
            for mode in ("ced", "full")}


def _state(cache):
    """Everything a layer holds, as comparable values."""
    out = []
    for c in cache:
        out += [c.offset, getattr(c, "trim_budget", 0), c.window.end, c.window.valid_from]
        out += [a for a in c.state]
        if c.compressed is not None:
            out.append(c.compressed.count)
        if c.engram_ids is not None:
            out.append(mx.array(c.engram_ids))
    return out


def _same(a, b):
    return len(a) == len(b) and all(
        mx.array_equal(x, y) if isinstance(x, mx.array) else x == y for x, y in zip(a, b))


class Stop(Exception):
    pass


@pytest.mark.parametrize("mode", ["ced", "full"])
@pytest.mark.parametrize("before", [0, 50])
@pytest.mark.slow
def test_failed_prefill_leaves_the_cache_as_it_was(models, prompt, mode, before):
    """A progress callback that raises after the second chunk: the cache is exactly as before
    the call, and the next call gives the logits of a cache that never saw the failed one."""
    model = models[mode]
    cache = model.make_cache()
    if before:
        model.prefill(prompt[:, :before], cache)
    saved = _state(cache)

    def stop(done, total):
        if done >= 40:
            raise Stop

    with pytest.raises(Stop):
        model.prefill(prompt[:, before:before + 100], cache, step_size=20, progress=stop)
    assert _same(_state(cache), saved)
    fresh = model.make_cache()
    if before:
        model.prefill(prompt[:, :before], fresh)
    step = prompt[:, before:before + 30]
    assert mx.array_equal(model.prefill(step, cache, step_size=20),
                          model.prefill(step, fresh, step_size=20))


def test_interrupt_in_a_decode_step_leaves_the_cache(models, prompt, monkeypatch):
    """Ctrl-C inside the forward (here: in the head) rolls the step back."""
    model = models["full"]
    cache = model.make_cache()
    model.prefill(prompt[:, :30], cache)
    saved = _state(cache)
    head = model.head

    def interrupted(*a):
        raise KeyboardInterrupt

    monkeypatch.setattr(model, "head", interrupted)
    with pytest.raises(KeyboardInterrupt):
        model(prompt[:, 30:31], cache=cache)
    monkeypatch.setattr(model, "head", head)
    assert _same(_state(cache), saved)
    reference = model.make_cache()
    model.prefill(prompt[:, :30], reference)
    assert mx.array_equal(model(prompt[:, 30:32], cache=cache),
                          model(prompt[:, 30:32], cache=reference))


def test_short_caches_report_their_whole_rollback(models, prompt):
    """A 10-token cache can undo all 10 tokens (the ring still holds every position); the
    old bound said 0 for any cache under ~2 windows. Trim then redo is exact."""
    for mode, model in models.items():
        cache = model.make_cache()
        model.prefill(prompt[:, :10], cache)
        assert {c.max_trim() for c in cache} == {10}, mode
        first = model(prompt[:, 10:11], cache=cache)
        assert trim_cache(cache, 7) == 7 and cache[0].offset == 4
        model.prefill(prompt[:, 4:10], cache)
        assert mx.array_equal(model(prompt[:, 10:11], cache=cache), first)


def test_mlx_lm_trim_helpers_trim_what_they_can(models, prompt):
    """mlx-lm's `trim_prompt_cache` calls `trim(n)` on every layer: each trims the same
    min(n, budget) and reports it, so a request beyond the rollback trims as much as is exact
    instead of raising inside mlx-lm, and the layers stay at one position."""
    model = models["ced"]
    cache = model.make_cache()
    model.prefill(prompt[:, :100], cache)
    limit = cache[0].max_trim()
    assert 0 < limit < 60 and can_trim_prompt_cache(cache)
    assert trim_prompt_cache(cache, 60) == limit
    assert {c.offset for c in cache} == {100 - limit}
    assert trim_prompt_cache(cache, 5) == 0      # the budget is spent
    reference = models["full"].make_cache()
    models["full"].prefill(prompt[:, :100 - limit], reference)
    step = prompt[:, 100 - limit:101 - limit]
    assert mx.array_equal(model(step, cache=cache), models["full"](step, cache=reference))
    with pytest.raises(CacheError, match="count >= 0"):
        cache[0].trim(-1)


def test_commit_refuses_an_inconsistent_layer(models, prompt):
    model = models["full"]
    cache = model.make_cache()
    model.prefill(prompt[:, :9], cache)
    cache[3].window.end = 7
    with pytest.raises(CacheError, match="layer 3: the window ring's end is 7"):
        commit(cache, 9)


@pytest.mark.parametrize("ids", [mx.zeros((1, 0), mx.int32), mx.zeros((0,), mx.int32)])
def test_empty_input_is_a_clear_error(models, ids):
    cache = models["ced"].make_cache()
    with pytest.raises(ValueError, match="ids are empty"):
        models["ced"](ids, cache=cache)
    with pytest.raises(ValueError, match="empty"):
        prefill(models["ced"], [], cache)
    assert cache[0].offset == 0


def test_batch_mismatch_is_a_clear_error(models, prompt):
    model = models["full"]
    cache = model.make_cache()
    model.prefill(prompt[:, :5], cache)
    with pytest.raises(ValueError, match="ids have batch 2 but the cache holds batch 1"):
        model(mx.concatenate([prompt[:, 5:6]] * 2), cache=cache)
    assert cache[0].offset == 5


def test_bad_shapes_are_clear_errors(models, prompt):
    model = models["full"]
    with pytest.raises(ValueError, match=r"ids must be \[batch, length\]"):
        model(prompt[None])
    with pytest.raises(ValueError, match="input_embeddings must have shape"):
        model(prompt[:, :4], input_embeddings=mx.zeros((1, 4, 7)))
    with pytest.raises(ValueError, match="step_size must be a positive int"):
        model.prefill(prompt[:, :4], step_size=0)


def test_late_engram_layer_warns_and_runs_full():
    """A config whose Engram layer sits in the decoder cannot prefill encoder-only: one
    warning says so (no silent fallback)."""
    args = ModelArgs.from_file(golden_checkpoint("tiny") / "config.json")
    start = 7  # tiny: layers 0-6 encoder, 7-11 decoder
    args.text_config.engram_layer_ids = [1, start + 2]
    with pytest.warns(UserWarning, match="Engram layer 9 is not"):
        model = Model(args)
    assert model.prefill_mode == "full"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Model(args, prefill_mode="full")


def test_input_embeddings_replace_the_token_embeddings(models, prompt):
    model = models["ced"]
    ids = prompt[:, :40]
    x = model.model.embed_tokens(ids)
    assert mx.array_equal(model(ids, input_embeddings=x, last_only=True),
                          model(ids, last_only=True))
    other = model(ids, input_embeddings=x * 0.5, last_only=True)
    assert not mx.allclose(other, model(ids, last_only=True)).item()


@pytest.mark.slow
def test_taps_are_the_streams_entering_the_layer(models, prompt):
    """Taps (DSpark's inputs): the mean over the copies of the streams entering a layer, for
    every row a layer computes; chunked == one call; a CED decoder tap holds the halo rows,
    equal to the full prefill's last rows."""
    full, ced = models["full"], models["ced"]
    ids = prompt[:, :90]
    captured = {}
    out = full.forward(ids, taps=(3, 9), capture=captured)
    assert mx.array_equal(out.taps[3], mx.mean(captured["layers.2.out"], axis=2))
    chunked = full.forward(ids, taps=(3, 9), step_size=25, last_only=True)
    assert mx.array_equal(chunked.taps[3], out.taps[3])
    assert mx.array_equal(chunked.taps[9], out.taps[9])
    tapped = ced.forward(ids, taps=(3, 9), last_only=True)
    rows = tapped.taps[9].shape[1]
    assert 1 < rows < 90 and tapped.taps[3].shape[1] == 90
    assert mx.array_equal(tapped.taps[9], out.taps[9][:, -rows:])
