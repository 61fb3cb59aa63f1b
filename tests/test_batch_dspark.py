"""DSpark in a batch: every sequence drafts its own block, one forward verifies them all, and
each sequence emits exactly its batch-1 DSpark tokens (greedy: plain decoding's; sampled: what
its seed gives at batch 1), with the same drafts accepted, stops and max_tokens honoured inside
a block, and a cache holding exactly the emitted tokens; sequences join and leave mid-run; an
interrupted cycle changes no cache and no random stream. CPU backend (bit-exact batches)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mlx_v41
from conftest import golden_checkpoint, packed_state, reference_ops, slow
from mlx_v41.generation.api import prefill
from mlx_v41.generation.batch import BatchGenerator
from mlx_v41.generation import speculative
from mlx_v41.generation.speculative import DraftStats, Sampling, speculative_steps
from mlx_v41.model.batch import batch_forward

pytestmark = pytest.mark.usefixtures("cpu")

STEP = 16  # prefill chunk, as tests/test_batch.py's
SAMPLING = Sampling(temp=1.0, top_p=0.9)


@pytest.fixture(scope="module")
def loaded():
    model, tokenizer = mlx_v41.load(golden_checkpoint("tiny"), dspark=True)
    return reference_ops(model), tokenizer


def prompts(lengths, seed=0) -> list:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 400, n).tolist() for n in lengths]  # below the special tokens


_TRUTH = {}


def truth(model, *texts, n=16) -> list:
    """Plain greedy tokens after each text (no stop tokens; one plain batch for those not
    memoised yet), those of the first text."""
    new = [text for text in texts if tuple(text) not in _TRUTH]
    if new:
        generator = BatchGenerator(model, stop_tokens=(), max_tokens=n, prefill_step_size=STEP)
        for text, (tokens, *_) in zip(new, run(generator, new)):
            _TRUTH[tuple(text)] = tokens
    return _TRUTH[tuple(texts[0])]


class Oracle:
    """Proposes each sequence's plain greedy continuation: per cycle the first `right` drafts
    are the true next tokens, the rest wrong (acceptance stops there). Sequences are told
    apart by their cache's first draft ring."""

    def __init__(self, model):
        self.model, self.known = model, {}

    def know(self, cache, prompt, right) -> list:
        self.known[id(cache[self.model.cfg.num_hidden_layers])] = (
            cache[0].offset + len(prompt), truth(self.model, prompt), right)
        return cache

    def draft(self, embed, lm_head, anchor, rings, sample=None):
        offset0, ahead, right = self.known[id(rings[0])]
        position = rings[0].offset - offset0 + 1  # index in the truth after the anchor
        ahead = ahead[position:position + 5] + [0] * 5
        vocab = self.model.cfg.vocab_size
        drafts = [t if i < right else (t + 1) % vocab for i, t in enumerate(ahead[:5])]
        logits = mx.where(mx.arange(vocab)[None] == mx.array(drafts)[:, None], 0.0, -1e9)
        tokens = mx.array([[anchor.item()] + drafts], dtype=mx.int32)
        return tokens, logits[None], mx.full((1, 5), 10.0)


def run(generator, texts, **insert) -> tuple:
    """Insert `texts`, step to the end: per text (token ids, from_draft flags, the last
    response's draft stats, the final cache)."""
    uids = generator.insert(texts, **insert)
    out = {uid: ([], [], None, None) for uid in uids}
    while len(generator):
        for r in generator.next():
            assert r.finish_reason != "error", r.error
            tokens, flags, _, _ = out[r.uid]
            if r.token >= 0:
                tokens.append(r.token)
                flags.append(r.from_draft)
            out[r.uid] = (tokens, flags, r.draft_stats, r.prompt_cache)
    return tuple(out[uid] for uid in uids)


def alone(model, tokenizer, prompt, max_tokens, k, sampler=None, seed=None) -> list:
    """Token ids of a batch-1 DSpark `stream_generate` (the stop token included)."""
    if seed is not None:
        mx.random.seed(seed)
    return [r.token for r in mlx_v41.stream_generate(
        model, tokenizer, prompt, max_tokens=max_tokens, sampler=sampler, draft="dspark",
        num_draft_tokens=k, prefill_step_size=STEP)]


def speculate(model, prompt, max_tokens, oracle, right, stops=(), sampling=Sampling(),
              seed=None, processors=None):
    """Batch-1 `speculative_steps` with an `Oracle` right `right` times per cycle: (tokens,
    from_draft flags, stats, cache)."""
    cache = oracle.know(model.make_cache(), prompt, right)
    logits = prefill(model, prompt, cache, step_size=STEP)
    if seed is not None:
        mx.random.seed(seed)
    stats = DraftStats()
    out = list(speculative_steps(model, logits, cache, sampling=sampling, max_tokens=max_tokens,
                                 stops=stops, stats=stats, drafter=oracle,
                                 logits_processors=processors, history=prompt))
    return [t for t, _, _ in out], [d for _, _, d in out], stats, cache


def committed(model, cache) -> list:
    """Every byte a later call can read: positions, packed state, Engram ids, draft rings."""
    out = [c.offset for c in cache] + packed_state(cache)
    out += [mx.array(c.engram_ids) for c in cache if c.engram_ids is not None]
    return out + [model.dspark.ring_keys(r, r.offset) for r in cache[model.cfg.num_hidden_layers:]]


def same(a, b) -> bool:
    return len(a) == len(b) and all(
        x == y if isinstance(x, int) else mx.array_equal(x, y).item() for x, y in zip(a, b))


def holds_exactly(model, cache, ids) -> bool:
    """The cache equals a plain prefill of `ids` (prompt and emitted tokens) byte for byte."""
    reference = model.make_cache()
    prefill(model, ids, reference)
    return same(committed(model, cache), committed(model, reference))


@pytest.mark.slow
def test_greedy_equals_plain_and_batch_one(loaded):
    """The checkpoint's drafter, prompts of mixed lengths: each sequence's tokens are plain
    greedy decoding's and batch-1 DSpark's."""
    model, tokenizer = loaded
    texts = prompts([1, 7, 16, 33, 70])
    truth(model, *texts)
    stops = tokenizer.eos_token_ids
    generator = BatchGenerator(model, stop_tokens=stops, max_tokens=8, prefill_step_size=STEP,
                               draft="dspark", num_draft_tokens=3)
    out = run(generator, texts)
    for text, (tokens, flags, stats, cache) in zip(texts, out):
        assert tokens == alone(model, tokenizer, text, 8, 3)
        plain = truth(model, text)[:8]
        cut = next((i + 1 for i, t in enumerate(plain) if t in stops), 8)
        assert tokens == plain[:cut]
        assert stats.proposed > 0 and sum(flags) == stats.accepted
        assert cache[0].offset == len(text) + len(tokens)


@pytest.mark.slow
def test_acceptance_stops_and_max_tokens_inside_blocks(loaded, monkeypatch):
    """Oracle drafters right 5, 2, 0, 3 or 4 times per cycle, max_tokens that end inside a
    block, a stop token inside an accepted block: each sequence emits what batch-1 DSpark
    emits with the same drafter (tokens, which of them are drafts, stats), and its cache holds
    exactly the emitted tokens. Blocks of several lengths are verified in one forward a step
    (the shorter ones padded, their padding trimmed)."""
    model, _ = loaded
    texts = prompts([3, 16, 9, 40, 21], seed=1)
    rights, max_tokens = [5, 2, 0, 3, 4], [13, 10, 6, 11, 14]
    stop = truth(model, *texts)[8]  # inside the second block of the first sequence
    oracle = Oracle(model)
    caches = [oracle.know(model.make_cache(), text, right) for text, right in zip(texts, rights)]
    generator = BatchGenerator(model, stop_tokens=[stop], prefill_step_size=STEP,
                               # steps counted on the one-chunk-a-step schedule
                               decode_prefill_budget=None, draft="dspark", num_draft_tokens=5)
    generator.drafter = oracle
    verified, lengths = [], []  # per verify forward [sequences, rows]; per block its length
    block = speculative.Speculation.block

    def counted(model, ids, caches):
        verified.append((generator.counters.generation_tokens, list(ids.shape)))
        return batch_forward(model, ids, caches)

    def measured(self, *args):
        ids = block(self, *args)
        lengths.append((generator.counters.generation_tokens, len(ids)))
        return ids

    monkeypatch.setattr(speculative, "batch_forward", counted)
    monkeypatch.setattr(speculative.Speculation, "block", measured)
    out = run(generator, texts, max_tokens=max_tokens, caches=caches)
    steps = [step for step, _ in verified]
    assert len(steps) == len(set(steps))  # one verify forward a step
    assert max(shape[0] for _, shape in verified) >= 3  # sequences verified together
    assert any(len({n for at, n in lengths if at == step}) > 1 for step in steps)  # mixed
    assert out[0][0][-1] == stop and len(out[0][0]) <= 9
    for text, right, n, (tokens, flags, stats, cache) in zip(texts, rights, max_tokens, out):
        one_tokens, one_flags, one_stats, _ = speculate(model, text, n, oracle, right, [stop])
        assert (tokens, flags) == (one_tokens, one_flags)
        assert (stats.proposed, stats.accepted, stats.cycles) == \
            (one_stats.proposed, one_stats.accepted, one_stats.cycles)
        assert stats.accepted == len(tokens) - stats.cycles
        assert holds_exactly(model, cache, text + tokens)
    assert generator.counters.drafts_accepted == sum(o[2].accepted for o in out) > 0


@pytest.mark.slow
def test_a_block_at_the_context_end_is_verified_apart(loaded, monkeypatch):
    """A sequence whose last block is cut by the context's end cannot be padded (no room):
    it is verified in a call of its own beside the others', and every sequence still emits
    its batch-1 tokens and holds exactly them."""
    model, _ = loaded
    texts = prompts([3, 40], seed=2)
    oracle = Oracle(model)
    rights = [5, 5]
    caches = [oracle.know(model.make_cache(), text, right) for text, right in zip(texts, rights)]
    generator = BatchGenerator(model, stop_tokens=(), prefill_step_size=STEP,
                               decode_prefill_budget=None, draft="dspark", num_draft_tokens=5)
    generator.drafter = oracle
    verified = []

    def counted(model, ids, caches):
        verified.append((generator.counters.generation_tokens, list(ids.shape)))
        return batch_forward(model, ids, caches)

    with monkeypatch.context() as patch:  # room 9 after the long prompt: 6 + 3 tokens
        patch.setattr(model.cfg, "max_position_embeddings", 40 + 9)
        patch.setattr(speculative, "batch_forward", counted)
        out = run(generator, texts, max_tokens=[24, 12], caches=caches)
    steps = [step for step, _ in verified]
    assert any(steps.count(step) == 2 for step in steps)  # the cut block apart once
    assert len(out[1][0]) == 9  # the context's end
    for text, right, (tokens, flags, _, cache) in zip(texts, rights, out):  # the limit back
        one_tokens, one_flags, _, _ = speculate(model, text, len(tokens), oracle, right)
        assert (tokens, flags) == (one_tokens, one_flags)
        assert holds_exactly(model, cache, text + tokens)


@pytest.mark.slow
def test_seeded_sampling_equals_batch_one(loaded):
    """Temperature 1, top-p 0.9, the checkpoint's drafter: each sequence's tokens are what
    batch-1 DSpark sampling gives it with its seed."""
    model, tokenizer = loaded
    texts = prompts([2, 16, 33], seed=2)
    seeds = [5, 6, 7]
    generator = BatchGenerator(model, stop_tokens=tokenizer.eos_token_ids, max_tokens=8,
                               prefill_step_size=STEP, sampler=SAMPLING, draft="dspark",
                               num_draft_tokens=2)
    out = run(generator, texts, seeds=seeds)
    sampled = [alone(model, tokenizer, text, 8, 2, SAMPLING, seed)
               for text, seed in zip(texts, seeds)]
    assert [o[0] for o in out] == sampled
    assert sampled[0] != alone(model, tokenizer, texts[0], 8, 2, SAMPLING, 1005)
    assert sampled != [truth(model, *texts[i:])[:8] for i in range(len(texts))]


@pytest.mark.slow
def test_joins_and_leaves_mid_run(loaded):
    """Sequences inserted while others decode, one removed mid-prefill and one mid-decode:
    every sequence that runs to its end emits its batch-1 tokens and drafts."""
    model, tokenizer = loaded
    texts = prompts([5, 40, 3, 90, 12], seed=3)
    truth(model, *texts)
    oracle = Oracle(model)
    generator = BatchGenerator(model, stop_tokens=(), max_tokens=10, prefill_step_size=STEP,
                               # steps counted on the one-chunk-a-step schedule
                               decode_prefill_budget=None, draft="dspark", num_draft_tokens=4)
    generator.drafter = oracle
    out = {}

    def insert(some):
        caches = [oracle.know(model.make_cache(), text, 3) for text in some]
        return generator.insert(some, caches=caches)

    def step():
        for r in generator.next():
            out.setdefault(r.uid, []).append((r.token, r.from_draft))

    first = insert(texts[:2])
    for _ in range(2):
        step()
    later = insert(texts[2:4])
    step()
    assert any(s.uid == later[1] for s in generator.prefilling)  # 90 tokens: still reading
    generator.remove([later[1]])
    step()
    cut_decode = first[1]
    assert any(s.uid == cut_decode for s in generator.decoding)
    generator.remove([cut_decode])
    last = insert(texts[4:])
    while len(generator):
        step()
    for uid, text in zip(first + later + last, texts):
        if uid in (later[1], cut_decode):
            continue
        tokens, flags, _, _ = speculate(model, text, 10, oracle, 3)
        assert out[uid] == list(zip(tokens, flags)), uid
    assert later[1] not in out


@pytest.mark.slow
def test_an_interrupted_cycle_changes_no_cache_nor_random_stream(loaded, monkeypatch):
    """Ctrl-C in the verify forward: no cache changed, no sequence's random stream advanced;
    the batch goes on and each seeded sequence still samples its batch-1 tokens."""
    model, _ = loaded
    texts = prompts([8, 25], seed=4)
    oracle = Oracle(model)
    caches = [oracle.know(model.make_cache(), text, 2) for text in texts]
    generator = BatchGenerator(model, stop_tokens=(), max_tokens=9, prefill_step_size=STEP,
                               sampler=SAMPLING, draft="dspark", num_draft_tokens=3)
    generator.drafter = oracle
    uids = generator.insert(texts, caches=caches, seeds=[11, 12])
    out = {}
    for _ in range(3):
        for r in generator.next():
            out.setdefault(r.uid, []).append(r.token)
    assert all(s.spec is not None for s in generator.decoding)
    before = [([c.offset for c in s.cache], s.key.seed) for s in generator.decoding]

    def interrupted(self, hidden, last_only):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(type(model), "head", interrupted)
        with pytest.raises(KeyboardInterrupt):
            generator.next()
    assert [([c.offset for c in s.cache], s.key.seed) for s in generator.decoding] == before
    while len(generator):
        for r in generator.next():
            out.setdefault(r.uid, []).append(r.token)
    for uid, text, seed in zip(uids, texts, [11, 12]):
        assert out[uid] == speculate(model, text, 9, oracle, 2, sampling=SAMPLING, seed=seed)[0]


def test_forks_and_a_failing_sequence(loaded):
    """Forks of one prefill draft apart, each sampling its batch-1 DSpark tokens with its seed;
    a sequence whose processor raises mid-run fails alone, its cache holding exactly what it
    emitted (the anchor fed in the failed cycle included)."""
    model, tokenizer = loaded
    text, other = prompts([10, 20], seed=6)

    def bad(history, logits):
        if history.shape[0] > len(other) + 3:
            raise RuntimeError("processor broke")
        return logits

    generator = BatchGenerator(model, stop_tokens=(), max_tokens=5, prefill_step_size=STEP,
                               sampler=SAMPLING, draft="dspark", num_draft_tokens=2)
    parent, broken = generator.insert([text, other], seeds=[21, None],
                                      logits_processors=[None, [bad]])
    child = generator.fork(parent, 1, seeds=[22])[0]
    out, error = {}, None
    while len(generator):
        for r in generator.next():
            if r.finish_reason == "error":
                error, cache = r.error, r.prompt_cache
            elif r.token >= 0:
                out.setdefault(r.uid, []).append(r.token)
    for uid, seed in ((parent, 21), (child, 22)):
        assert out[uid] == alone(model, tokenizer, text, 5, 2, SAMPLING, seed), uid
    assert "processor broke" in str(error) and 0 < len(out[broken]) < 5
    assert cache[0].offset == len(other) + len(out[broken])


@pytest.mark.parametrize("right", [slow(5), slow(0)])
def test_logits_processors_per_sequence(loaded, right):
    """Per-sequence logits processors (a repetition penalty on one, none on the other) shape
    every verify row as at batch 1."""
    from mlx_lm.sample_utils import make_logits_processors

    model, _ = loaded
    texts = prompts([6, 30], seed=5)
    penalty = make_logits_processors(repetition_penalty=4.0, repetition_context_size=64)
    oracle = Oracle(model)
    caches = [oracle.know(model.make_cache(), text, right) for text in texts]
    generator = BatchGenerator(model, stop_tokens=(), max_tokens=12, prefill_step_size=STEP,
                               draft="dspark", num_draft_tokens=5)
    generator.drafter = oracle
    out = run(generator, texts, caches=caches, logits_processors=[penalty, None])
    assert out[0][0] != truth(model, texts[0])[:12]  # the penalty changes the output
    for text, processors, (tokens, flags, _, _) in zip(texts, [penalty, None], out):
        assert (tokens, flags) == speculate(model, text, 12, oracle, right,
                                            processors=processors)[:2]


def test_bad_settings_are_refused(loaded):
    model, _ = loaded
    with pytest.raises(ValueError, match="mlx_v41.Sampling"):
        BatchGenerator(model, draft="dspark", sampler=lambda logprobs: logprobs)
    with pytest.raises(ValueError, match="num_draft_tokens must be an int in 1..5"):
        BatchGenerator(model, draft="dspark", num_draft_tokens=6)
    with pytest.raises(ValueError, match="draft must be None or 'dspark'"):
        BatchGenerator(model, draft="medusa")
    generator = BatchGenerator(model, draft="dspark")
    with pytest.raises(ValueError, match="mlx_v41.Sampling"):
        generator.insert([[1, 2], [3]], samplers=[None, lambda logprobs: logprobs])
    assert len(generator) == 0  # nothing of a refused insert was queued
    plain = mlx_v41.load_model(golden_checkpoint("tiny"), dspark=False)
    with pytest.raises(ValueError, match="loaded without it"):
        BatchGenerator(plain, draft="dspark")
