"""Continuous batching: every sequence of a batch gets, at every step, the logits it gets alone
at batch 1, bit for bit on MLX's CPU backend (the `cpu` fixture), for prompts of different
lengths (different window fill, compressor phase, Engram history), sequences joining and
leaving mid-run, prompts prefilled in chunks between decode steps, seeded sampling, per-sequence
processors; a failing sequence fails alone; an interrupted step changes no cache."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mlx_v41
from conftest import golden_checkpoint, packed_state, reference_ops, slow
from mlx_v41.cache.stacked import is_shared
from mlx_v41.generation.batch import BatchGenerator
from mlx_v41.generation.sequence import RandomKey
from mlx_v41.generation.batch_generate import batch_generate
from mlx_v41.model.batch import batch_forward

pytestmark = pytest.mark.usefixtures("cpu")

# Lengths around the tiny model's window (16) and compression group (2): empty-window,
# odd/even (open compressor group or not), several windows long.
LENGTHS = [1, 2, 7, 16, 33, 70]
STEP = 16  # prefill chunk: long prompts take several


@pytest.fixture(scope="module")
def loaded():
    model, tokenizer = mlx_v41.load(golden_checkpoint("tiny"))
    return reference_ops(model), tokenizer


def prompts(lengths, seed=0) -> list:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 400, n).tolist() for n in lengths]  # below the special tokens


def alone(model, tokenizer, prompt, max_tokens=8, sampler=None, seed=None, processors=None):
    """Token ids of a batch-1 `stream_generate` (the stop token included, as streamed)."""
    if seed is not None:
        mx.random.seed(seed)
    return [r.token for r in mlx_v41.stream_generate(
        model, tokenizer, prompt, max_tokens=max_tokens, sampler=sampler,
        logits_processors=processors, prefill_step_size=STEP)]


def run(generator, uids=None) -> dict:
    """Step the generator until it is empty: uid -> emitted token ids (errors as exceptions)."""
    out = {}
    while len(generator):
        for r in generator.next():
            if r.token >= 0:
                out.setdefault(r.uid, []).append(r.token)
            if r.finish_reason == "error":
                out[r.uid] = r.error
    return out


def test_batch_forward_equals_batch_one_per_step(loaded):
    model, _ = loaded
    texts = prompts(LENGTHS)
    follow = prompts([10] * len(LENGTHS), seed=1)

    def prefilled(ids):
        cache = model.make_cache()
        model.prefill(mx.array([ids]), cache, step_size=STEP)
        return cache

    expected = []
    for ids, cont in zip(texts, follow):
        cache = prefilled(ids)
        expected.append([np.array(model(mx.array([[t]]), cache=cache)[0, -1]) for t in cont])
    caches = [prefilled(ids) for ids in texts]
    for step in range(len(follow[0])):
        logits = batch_forward(model, mx.array([[c[step]] for c in follow]), caches).logits
        for b in range(len(texts)):
            assert np.array_equal(np.array(logits[b, -1]), expected[b][step]), (step, b)
    assert [c[0].offset for c in caches] == [n + len(follow[0]) for n in LENGTHS]


@pytest.mark.slow
def test_full_and_short_windows_in_one_step(loaded, monkeypatch):
    """Sequences whose window is full and those whose window is still filling attend stacked
    in one call per layer (their rings, selections and attention at once; a short window
    padded at the front and left out of the attention), and the steps cross the window's
    filling, compression groups (ratio 2 every other step, ratio 1 every step) and the
    stacked selection's padding: each sequence's logits stay those of batch 1 at every
    step."""
    from mlx_v41.model.attention import Attention

    model, _ = loaded
    lengths = [3, 40, 12, 15, 71, 8]  # window 16: full from position 15 on
    texts, follow = prompts(lengths, seed=5), prompts([13] * len(lengths), seed=6)
    expected = []
    for ids, cont in zip(texts, follow):
        cache = model.make_cache()
        model.prefill(mx.array([ids]), cache, step_size=STEP)
        expected.append([np.array(model(mx.array([[t]]), cache=cache)[0, -1]) for t in cont])
    caches = []
    for ids in texts:
        caches.append(model.make_cache())
        model.prefill(mx.array([ids]), caches[-1], step_size=STEP)
    calls = {"stacked": 0, "alone": 0}
    stacked, alone = Attention._attend_stacked, Attention._attend

    def count(name, fn):
        def counted(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return counted

    monkeypatch.setattr(Attention, "_attend_stacked", count("stacked", stacked))
    monkeypatch.setattr(Attention, "_attend", count("alone", alone))
    for step in range(len(follow[0])):
        calls.update(stacked=0, alone=0)
        logits = batch_forward(model, mx.array([[c[step]] for c in follow]), caches).logits
        for b in range(len(texts)):
            assert np.array_equal(np.array(logits[b, -1]), expected[b][step]), (step, b)
        layers = model.cfg.num_hidden_layers  # attention layers (the cache has the draft too)
        assert calls == {"stacked": layers, "alone": 0}  # 3 full windows, 3 short ones


@pytest.mark.slow
def test_batch_generate_greedy_and_seeded(loaded):
    model, tokenizer = loaded
    from mlx_lm.sample_utils import make_sampler

    texts = prompts(LENGTHS, seed=2)
    out = batch_generate(model, tokenizer, texts, max_tokens=8, prefill_step_size=STEP,
                         return_token_ids=True)
    stops = set(tokenizer.eos_token_ids)
    for text, ids in zip(texts, out.token_ids):
        assert ids == [t for t in alone(model, tokenizer, text) if t not in stops]
    assert out.texts == [tokenizer.decode(ids) for ids in out.token_ids]
    assert out.stats.generation_tokens >= sum(len(ids) for ids in out.token_ids)

    sampler = make_sampler(1.0, top_p=0.9)
    seeds = [7 + i for i in range(len(texts))]
    out = batch_generate(model, tokenizer, texts, max_tokens=8, prefill_step_size=STEP,
                         return_token_ids=True, sampler=sampler, seeds=seeds)
    sampled = [[t for t in alone(model, tokenizer, text, sampler=sampler, seed=seed)
                if t not in stops] for text, seed in zip(texts, seeds)]
    assert out.token_ids == sampled
    assert len({tuple(s) for s in sampled}) > 1  # the seeds matter
    assert out.token_ids != [[t for t in alone(model, tokenizer, text, sampler=sampler,
                                               seed=seed + 1000) if t not in stops]
                             for text, seed in zip(texts, seeds)]


@pytest.mark.slow
def test_joins_and_leaves_mid_run(loaded):
    """Sequences inserted while others decode, one removed mid-prefill and one mid-decode:
    every sequence that runs to its end emits what it emits alone."""
    model, tokenizer = loaded
    texts = prompts([5, 40, 3, 90, 12, 21], seed=3)
    generator = BatchGenerator(model, stop_tokens=tokenizer.eos_token_ids, max_tokens=10,
                               prefill_step_size=STEP)
    first = generator.insert(texts[:2])
    out = {}

    def step():
        for r in generator.next():
            out.setdefault(r.uid, []).append(r.token)

    for _ in range(3):
        step()
    later = generator.insert(texts[2:5])
    step()
    cut_prefill = later[1]  # 90 tokens: still prefilling after one step
    assert any(s.uid == cut_prefill for s in generator.prefilling)
    generator.remove([cut_prefill])
    step()
    decoding = [s.uid for s in generator.decoding]
    cut_decode = decoding[0]
    generator.remove([cut_decode])
    last = generator.insert(texts[5:])
    while len(generator):
        step()
    uids = first + later + last
    for uid, text in zip(uids, texts):
        if uid in (cut_prefill, cut_decode):
            continue
        assert out[uid] == alone(model, tokenizer, text, max_tokens=10), uid
    assert cut_prefill not in out


def test_rings_stay_stacked_between_steps(loaded, monkeypatch):
    """A step updates the window rings of the batch in the stacked array the step before it
    wrote, not in a new concatenation of per-sequence rings (only a change of members
    restacks them); a sequence that leaves takes its own rows out (its cache keeps no row of
    the batch's arrays); every sequence emits what it emits alone."""
    import mlx_v41.model.attention as attention
    model, tokenizer = loaded
    texts, lengths = prompts([20, 33, 41], seed=11), [4, 9, 9]
    written, read = [], []

    def recording(rows, values, positions):
        out = update(rows, values, positions)
        if rows.shape[0] > 1:
            read.append(rows)
        written.append(out)
        return out

    update = attention.swa_ring_update
    monkeypatch.setattr(attention, "swa_ring_update", recording)
    generator = BatchGenerator(model, stop_tokens=(), prefill_step_size=64)
    uids = generator.insert(texts, max_tokens=lengths)
    out, caches, pooled = {}, {}, 0
    while len(generator):
        for r in generator.next():
            out.setdefault(r.uid, []).append(r.token)
            if r.finish_reason is not None:
                caches[r.uid] = r.prompt_cache
        if len(generator.decoding) > 1:  # the compressed rows stay stacked too
            stores = [[c.compressed for c in s.cache if c.compressed is not None]
                      for s in generator.decoding]
            pooled += all(is_shared(kv, name) for one in stores for kv in one
                          for name in ("kv", "index_k", "inputs") if kv.ratio > 1 or
                          name != "inputs")
    layers = model.cfg.num_hidden_layers
    restacked = sum(not any(rows is made for made in written) for rows in read)
    assert len(read) >= 6 * layers and restacked <= 3 * layers, (len(read), restacked)
    assert pooled >= 2
    for cache in caches.values():
        assert not any(is_shared(c.window, "rows") for c in cache)
        assert all(c.window.rows.shape[0] == 1 for c in cache if c.window.allocated)
        for kv in (c.compressed for c in cache if c.compressed is not None):
            assert not any(is_shared(kv, name) for name in ("kv", "index_k", "inputs"))
            assert kv.kv.shape[:2] == (1, 256) and kv.index_k.shape[:2] == (1, 256)
    for uid, text, n in zip(uids, texts, lengths):
        assert out[uid] == alone(model, tokenizer, text, max_tokens=n), uid


@pytest.mark.parametrize("kept", [16, 512])
def test_engram_histories_stay_stacked_between_steps(loaded, monkeypatch, kept):
    """A step hashes and extends the history array the step before kept, and each sequence's
    history is a row of it, whether the sequences keep as many Engram ids as each other
    (ENGRAM_KEPT = 16: all past it) or not (512, as in use: each its own length, the rows
    right-aligned); a sequence that leaves takes its own ids out, those of a batch-1 cache of
    its tokens; every sequence emits what it emits alone."""
    import mlx_v41.cache.layer as layer
    import mlx_v41.model.engram as engram
    monkeypatch.setattr(layer, "ENGRAM_KEPT", kept)
    model, tokenizer = loaded
    layers = model.cfg.engram_layer_ids
    assert len(layers) == 2
    shared, taken = [], []

    def sharing(holders, name, array, lengths=None):
        shared.append(array)
        return share(holders, name, array, lengths)

    def taking(holders, name):
        out = stacked_right(holders, name)
        taken.append(out[0])
        return out

    share, stacked_right = engram.share, engram.stacked_right
    monkeypatch.setattr(engram, "share", sharing)
    monkeypatch.setattr(engram, "stacked_right", taking)
    texts, lengths = prompts([20, 33, 41], seed=12), [5, 9, 9]
    generator = BatchGenerator(model, stop_tokens=(), prefill_step_size=64)
    uids = generator.insert(texts, max_tokens=lengths)
    out, caches, rows = {}, {}, 0
    while len(generator):
        for r in generator.next():
            out.setdefault(r.uid, []).append(r.token)
            if r.finish_reason is not None:
                caches[r.uid] = r.prompt_cache
        if len(generator.decoding) > 1:
            rows += all(is_shared(s.cache[i], "engram_ids") for s in generator.decoding
                        for i in layers)
    reused = sum(any(array is made for made in shared) for array in taken)
    assert len(taken) >= 6 and reused >= len(taken) - 2, (len(taken), reused)  # 2 restacks
    assert rows >= 5 and len(shared) == 2 * len(taken)
    for uid, text, n in zip(uids, texts, lengths):
        assert out[uid] == alone(model, tokenizer, text, max_tokens=n), uid
        cache = caches[uid]
        assert not any(is_shared(cache[i], "engram_ids") for i in layers)
        assert cache[layers[0]].engram_ids is cache[layers[1]].engram_ids  # one copy out
        single = model.make_cache()  # the prompt and every token the cache was fed
        model.prefill(mx.array([text + out[uid]]), single, step_size=64)
        assert single[0].offset == cache[0].offset
        want = np.array(single[layers[0]].engram_ids)
        assert want.shape == (1, min(kept, cache[0].offset))
        assert all(np.array_equal(np.array(cache[i].engram_ids), want) for i in layers), uid


@pytest.mark.slow
def test_long_prefill_does_not_stall_decoding(loaded):
    """A long prompt is read one chunk per step while the others decode; a short prompt that
    arrives behind it starts after a chunk, and every output equals its batch-1 one."""
    model, tokenizer = loaded
    short, long_, late = prompts([4, 200, 6], seed=4)
    generator = BatchGenerator(model, stop_tokens=(), max_tokens=30, prefill_step_size=STEP)
    a = generator.insert([short])[0]
    out = {}
    for r in generator.next():
        out.setdefault(r.uid, []).append(r.token)
    b = generator.insert([long_])[0]
    emitted_during_prefill, steps = 0, 0
    c, first_token_step = None, None
    while any(s.uid == b for s in [*generator.waiting, *generator.prefilling]):
        responses = generator.next()
        steps += 1
        emitted_during_prefill += sum(r.uid == a for r in responses)
        for r in responses:
            out.setdefault(r.uid, []).append(r.token)
        if steps == 2:
            c = generator.insert([late])[0]
        if c is not None and c in out and first_token_step is None:
            first_token_step = steps
    assert steps >= 200 // STEP  # the long prompt took one chunk per step
    assert emitted_during_prefill >= steps - 1  # the short one kept decoding meanwhile
    assert first_token_step is not None and first_token_step <= 5  # not behind the long one
    rest = run(generator)
    for uid, ids in rest.items():
        out.setdefault(uid, []).extend(ids)
    for uid, text in ((a, short), (b, long_), (c, late)):
        assert out[uid] == alone(model, tokenizer, text, max_tokens=30), uid


@pytest.mark.slow
def test_a_failing_sequence_fails_alone(loaded):
    model, tokenizer = loaded
    texts = prompts([9, 14, 30], seed=5)

    def bad(history, logits):
        if history.shape[0] > len(texts[1]) + 2:
            raise RuntimeError("processor broke")
        return logits

    def at_once(history, logits):
        raise RuntimeError("processor broke at the first token")

    generator = BatchGenerator(model, stop_tokens=tokenizer.eos_token_ids, max_tokens=8,
                               prefill_step_size=STEP)
    uids = generator.insert(texts + texts[:1],
                            logits_processors=[None, [bad], None, [at_once]])
    out = run(generator)
    assert isinstance(out[uids[1]], RuntimeError)
    assert "first token" in str(out[uids[3]])
    for uid, text in ((uids[0], texts[0]), (uids[2], texts[2])):
        assert out[uid] == alone(model, tokenizer, text), uid
    with pytest.raises(ValueError, match="prompts\\[1\\] is empty"):
        generator.insert([[1, 2], []])
    assert len(generator) == 0  # nothing of a refused insert was queued
    uid = generator.insert([[model.cfg.vocab_size + 5, 1]])[0]
    assert "token ids must lie" in str(run(generator)[uid])


def test_an_interrupted_step_changes_no_cache(loaded, monkeypatch):
    model, tokenizer = loaded
    texts = prompts([8, 25], seed=6)
    generator = BatchGenerator(model, stop_tokens=(), max_tokens=6, prefill_step_size=STEP)
    generator.insert(texts)
    for _ in range(4):
        generator.next()
    before = [[c.offset for c in s.cache] for s in generator.decoding]
    arrays = [[np.array(a) for c in s.cache for a in c.state] for s in generator.decoding]
    original = type(model).head

    def interrupted(self, hidden, last_only):
        raise KeyboardInterrupt

    monkeypatch.setattr(type(model), "head", interrupted)
    with pytest.raises(KeyboardInterrupt):
        generator.next()
    monkeypatch.setattr(type(model), "head", original)
    assert [[c.offset for c in s.cache] for s in generator.decoding] == before
    assert all(np.array_equal(np.array(x), y) for s, was in zip(generator.decoding, arrays)
               for x, y in zip([a for c in s.cache for a in c.state], was))
    out = run(generator)
    assert len(out) == 2  # and the batch goes on


def test_prompt_caches_are_continued_not_changed(loaded):
    model, tokenizer = loaded
    prefix, *rest = prompts([20, 6, 11], seed=7)
    cache = model.make_cache()
    model.prefill(mx.array([prefix]), cache, step_size=STEP)
    offset = cache[0].offset
    out = batch_generate(model, tokenizer, rest, prompt_caches=[cache, cache], max_tokens=5,
                         prefill_step_size=STEP, return_token_ids=True,
                         return_prompt_caches=True)
    assert cache[0].offset == offset
    stops = set(tokenizer.eos_token_ids)
    for ids, text, final in zip(out.token_ids, rest, out.caches):
        expected = [t for t in alone(model, tokenizer, prefix + text, max_tokens=5)
                    if t not in stops]
        assert ids == expected
        assert final[0].offset >= offset + len(text) + len(ids)


def test_settings_are_checked(loaded):
    model, _ = loaded
    with pytest.raises(ValueError, match="completion_batch_size"):
        BatchGenerator(model, completion_batch_size=0)
    with pytest.raises(ValueError, match="seed"):
        RandomKey(-1)
    with pytest.raises(ValueError, match="seed"):
        RandomKey(2 ** 64)
    cache = model.make_cache()
    with pytest.raises(ValueError, match="twice"):
        batch_forward(model, mx.array([[1], [2]]), [cache, cache])
    with pytest.raises(ValueError, match="2 rows but 1 caches"):
        batch_forward(model, mx.array([[1], [2]]), [cache])


def test_random_keys_draw_as_seeded_runs_without_reading_back_each_draw():
    """Interleaved streams each draw what a run seeded alone draws; the key a draw leaves is
    kept as an array (read at the stream's next draw, not at once, which would wait for the
    step in flight)."""
    def alone(seed, draws):
        mx.random.seed(seed)
        return [mx.random.uniform(shape=(2,)).tolist() for _ in range(draws)]

    first, second = RandomKey(3), RandomKey(2 ** 64 - 5)
    got = {3: [], 2 ** 64 - 5: []}
    for key, seed in [(first, 3), (second, 2 ** 64 - 5), (first, 3), (first, 3),
                      (second, 2 ** 64 - 5)]:
        with key.active():
            drawn = mx.random.uniform(shape=(2,))
        assert key._left is not None  # not read back on leaving
        got[seed].append(drawn.tolist())
    with second.active():
        pass  # a greedy sample draws nothing: the key stays
    assert got[3] == alone(3, 3) and got[2 ** 64 - 5] == alone(2 ** 64 - 5, 2)

    mx.random.seed(3)
    for _ in range(3):
        mx.random.uniform(shape=(2,))
    high, low = mx.random.state[0].tolist()
    assert first.seed == (high << 32) | low  # the key three draws left, as a seed
    first.seed = 3  # restoring (an interrupted DSpark cycle) drops the kept key
    with first.active():
        assert mx.random.uniform(shape=(2,)).tolist() == alone(3, 1)[0]


@pytest.mark.parametrize("mode", [slow("full"), "ced_replay"])
@pytest.mark.slow
def test_other_prefill_modes(mode):
    model, tokenizer = mlx_v41.load(golden_checkpoint("tiny"), prefill_mode=mode)
    model = reference_ops(model)
    texts = prompts([3, 50, 19], seed=8)
    out = batch_generate(model, tokenizer, texts, max_tokens=5, prefill_step_size=STEP,
                         return_token_ids=True)
    stops = set(tokenizer.eos_token_ids)
    assert out.token_ids == [[t for t in alone(model, tokenizer, text, max_tokens=5)
                              if t not in stops] for text in texts]


@pytest.mark.slow
def test_forks_share_one_prefill(loaded):
    """n replies from one prefill: each fork samples as a batch-1 run with its seed would."""
    model, tokenizer = loaded
    from mlx_lm.sample_utils import make_sampler

    text, = prompts([37], seed=9)
    sampler = make_sampler(1.0)
    generator = BatchGenerator(model, stop_tokens=(), max_tokens=6, prefill_step_size=STEP)
    parent = generator.insert([text], samplers=[sampler], seeds=[1])[0]
    children = generator.fork(parent, 3, samplers=[sampler] * 3, seeds=[2, 3, 4])
    gone = generator.fork(parent, 1)[0]
    generator.remove([gone])
    out = run(generator)
    assert sorted(out) == sorted([parent, *children])
    assert generator.counters.prompt_tokens == len(text)  # one prefill
    for uid, seed in zip([parent, *children], [1, 2, 3, 4]):
        assert out[uid] == alone(model, tokenizer, text, max_tokens=6, sampler=sampler,
                                 seed=seed), uid
    assert len({tuple(v) for v in out.values()}) > 1
    with pytest.raises(ValueError, match="not waiting"):
        generator.fork(parent, 1)


@pytest.mark.metal
@pytest.mark.skipif(not mx.metal.is_available(), reason="needs a Metal device (macOS)")
def test_metal_batch_difference_is_bounded():
    """On the GPU a batch's matmuls may sum in another order than batch 1's: each sequence's
    logits stay within a small fraction of their spread of its batch-1 logits, and the first
    greedy token agrees (bound not yet measured on a Mac: loose on purpose)."""
    model = mlx_v41.load_model(golden_checkpoint("tiny"))  # default kernels, on the GPU
    texts = prompts(LENGTHS, seed=10)
    with mx.stream(mx.gpu):
        alone_logits, caches = [], []
        for ids in texts:
            cache = model.make_cache()
            alone_logits.append(model.prefill(mx.array([ids]), cache, step_size=STEP))
            caches.append(cache)
        tokens = [int(mx.argmax(logits[0, -1]).item()) for logits in alone_logits]
        singles = [model.make_cache() for _ in texts]
        for ids, cache in zip(texts, singles):
            model.prefill(mx.array([ids]), cache, step_size=STEP)
        want = [model(mx.array([[t]]), cache=c)[0, -1] for t, c in zip(tokens, singles)]
        got = batch_forward(model, mx.array([[t] for t in tokens]), caches).logits[:, -1]
        for b, expected in enumerate(want):
            spread = (mx.max(expected) - mx.min(expected)).item()
            difference = mx.max(mx.abs(got[b] - expected)).item()
            assert difference <= 1e-2 * spread, (b, difference, spread)
            assert mx.argmax(got[b]).item() == mx.argmax(expected).item()


@pytest.mark.slow
def test_stacked_compressor_and_engram_at_mixed_phases(loaded):
    """Every sequence past its window (all attend stacked) and past the Engram n-gram
    history (one hash for all), at odd and even positions (open compressor group or not),
    stepping one, two or three rows: each step's logits equal batch 1's. The open groups a
    step leaves stay in the stacked input ring (a slot, nothing copied out), and each cache
    then goes on alone with batch 1's logits and bytes."""
    model, _ = loaded
    texts = prompts([17, 18, 33, 40, 51])
    blocks = [1, 2, 1, 1, 3, 2, 1, 3, 1]
    follow = prompts([sum(blocks)] * len(texts), seed=2)

    def prefilled(ids):
        cache = model.make_cache()
        model.prefill(mx.array([ids]), cache, step_size=STEP)
        return cache

    alone_caches = [prefilled(ids) for ids in texts]
    caches = [prefilled(ids) for ids in texts]
    done = 0
    for step, n in enumerate(blocks):
        rows = [cont[done:done + n] for cont in follow]
        logits = batch_forward(model, mx.array(rows), caches).logits
        for b, (row, cache) in enumerate(zip(rows, alone_caches)):
            expected = np.array(model(mx.array([row]), cache=cache)[0])
            assert np.array_equal(np.array(logits[b]), expected), (step, b)
        done += n
    assert [c[0].offset for c in caches] == [len(t) + done for t in texts]
    owners = [c.compressed for cache in caches for c in cache
              if c.compressed is not None and c.compressed.ratio == 2]
    assert owners and {type(kv._pending) for kv in owners} == {int, type(None)}
    for cache, alone_cache in zip(caches, alone_caches):  # an open group in a slot counts too
        assert mlx_v41.cache_bytes(cache) == mlx_v41.cache_bytes(alone_cache)
    last = prompts([1] * len(texts), seed=3)
    for b, (cache, alone_cache) in enumerate(zip(caches, alone_caches)):
        got = model(mx.array([last[b]]), cache=cache)
        want = model(mx.array([last[b]]), cache=alone_cache)
        assert np.array_equal(np.array(got), np.array(want)), b
        for x, y in zip(packed_state(cache), packed_state(alone_cache), strict=True):
            assert x.shape == y.shape and mx.array_equal(x, y).item(), b


@pytest.mark.slow
def test_a_step_starts_the_next_tokens_before_it_reads_its_own(loaded, monkeypatch):
    """The decode step is pipelined: the next tokens (and logprobs) of the sequences without
    processors are handed to `mx.async_eval` before the step reads back the tokens it feeds
    (so their graph runs while the host emits), a sequence with processors samples once its
    token is known, and each sequence still emits its batch-1 tokens, stop token and
    max_tokens included."""
    model, tokenizer = loaded
    events = []
    real_async_eval, real_emit = mx.async_eval, BatchGenerator._emit_decoded

    def spy_async_eval(*arrays):
        flat = arrays[0] if len(arrays) == 1 and isinstance(arrays[0], list) else arrays
        events.append(("async_eval", len(flat)))
        return real_async_eval(*arrays)

    def spy_emit(self, *args):
        events.append(("emit",))
        return real_emit(self, *args)

    monkeypatch.setattr(mx, "async_eval", spy_async_eval)
    monkeypatch.setattr(BatchGenerator, "_emit_decoded", spy_emit)
    texts = prompts([3, 20, 9], seed=5)
    stop = alone(model, tokenizer, texts[0], max_tokens=4)[2]  # reply 0's third token
    seen = []

    def processor(history, logits):
        seen.append(int(history[-1].item()))  # the fed token's value: known when called
        return logits

    generator = BatchGenerator(model, stop_tokens=[stop], max_tokens=6, prefill_step_size=STEP)
    uids = generator.insert(texts, logits_processors=[None, None, [processor]])
    out, ahead_steps = {}, 0
    while len(generator):
        ahead = sum(1 for s in generator.decoding if s.token is not None
                    and not s.processors and s.generated + 1 < s.max_tokens)
        events.clear()
        for r in generator.next():
            out.setdefault(r.uid, []).append(r.token)
        if ahead:  # the first thing after the forward is built: their next tokens start
            assert events[:2] == [("async_eval", 2 * ahead), ("emit",)], events
            ahead_steps += 1
    assert ahead_steps >= 3
    calls = list(seen)  # the batch's calls (the batch-1 runs below call it too)
    for uid, text, procs in zip(uids, texts, [None, None, [processor]]):
        want = alone(model, tokenizer, text, max_tokens=6, processors=procs)
        assert out[uid] == (want[:want.index(stop) + 1] if stop in want else want), uid
    # its first call saw the prompt's last token, each later one the reply's token before
    assert len(calls) >= 2 and calls[0] == texts[2][-1]
    assert calls[1:] == out[uids[2]][:len(calls) - 1]


@pytest.mark.parametrize("axis, sizes, fill, align", [
    (1, [3, 0, 5, 1], 0, "left"), (2, [2, 5, 0], -1, "left"), (2, [4, 4], False, "left"),
    (1, [0, 0], 0, "left"), (1, [3, 0, 5, 1], 7, "right"), (1, [2, 2], 0, "right")])
def test_stack_padded_pads_each_part_with_the_fill(axis, sizes, fill, align):
    """`stack_padded` (the stacked path's padding: one concatenation and one gather) gives
    each part's rows, then `fill` (`align="right"`: `fill`, then the rows), as padding every
    part alone does."""
    from mlx_v41.cache.stacked import stack_padded

    rng = np.random.default_rng(len(sizes))
    dtype = np.bool_ if isinstance(fill, bool) else np.int32 if fill == -1 else np.uint8
    parts = []
    for n in sizes:
        shape = (1, n, 3) if axis == 1 else (1, 4, n)
        parts.append(rng.integers(0, 2 if dtype == np.bool_ else 200, shape).astype(dtype))
    longest = max(sizes)
    want = np.full((len(sizes),) + ((longest, 3) if axis == 1 else (4, longest)), fill, dtype)
    for g, part in enumerate(parts):
        if axis == 1 and align == "right":
            want[g, longest - part.shape[1]:] = part[0]
        elif axis == 1:
            want[g, :part.shape[1]] = part[0]
        else:
            want[g, :, :part.shape[2]] = part[0]
    got = stack_padded([mx.array(p) for p in parts], fill, axis=axis, align=align)
    assert got.shape == want.shape and np.array_equal(np.array(got), want)
