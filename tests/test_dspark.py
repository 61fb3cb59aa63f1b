"""DSpark speculative decoding: greedy output is plain greedy decoding's token for token, the
cache after every cycle holds exactly what a plain run over the committed tokens holds, the
rejection sampling is distributed as the target (a wrong acceptance rule fails the same
check), and bad settings are refused."""

import mlx.core as mx
import numpy as np
import pytest

import mlx_v41
from mlx_v41.chat.tokenizer import load_tokenizer
from mlx_v41.generation.api import generate_step, prefill
from mlx_v41.generation.speculative import (DraftStats, Sampling, _accept, check_draft_settings,
                                            speculative_steps)
from conftest import golden_checkpoint, packed_state, slow

# Exact equalities between a multi-row verify and single-row steps: the CPU backend's.
pytestmark = pytest.mark.usefixtures("cpu")

CHI2_DF3_P001 = 16.27  # chi-square bound, 3 degrees of freedom, p = 0.001


@pytest.fixture(scope="module")
def tiny(goldens, tiny_model):
    model = tiny_model(dspark=True)
    return model, goldens("tiny").prompt[:50].tolist()


_PLAIN = {}


def plain_run(model, prompt, n):
    """Plain greedy tokens and the cache after them (memoised per length)."""
    if n not in _PLAIN:
        cache = model.make_cache()
        logits = prefill(model, prompt, cache)
        tokens = [token for token, _ in generate_step(model, logits, cache, max_tokens=n)]
        _PLAIN[n] = tokens, cache
    return _PLAIN[n]


def committed(model, cache):
    """Every byte a later call can read: positions, packed state, Engram ids, draft rings."""
    out = [c.offset for c in cache] + packed_state(cache)
    out += [mx.array(c.engram_ids) for c in cache if c.engram_ids is not None]
    rings = cache[model.cfg.num_hidden_layers:]
    return out + [model.dspark.ring_keys(r, r.offset) for r in rings]


def same(a, b) -> bool:
    return len(a) == len(b) and all(
        x == y if isinstance(x, int) else mx.array_equal(x, y).item() for x, y in zip(a, b))


def speculate(model, prompt, n, **kwargs):
    cache = model.make_cache()
    logits = prefill(model, prompt, cache)
    stats = DraftStats()
    out = list(speculative_steps(model, logits, cache, sampling=kwargs.pop("sampling", Sampling()),
                                 max_tokens=n, stats=stats, **kwargs))
    return [t for t, _, _ in out], [d for _, _, d in out], cache, stats


class Oracle:
    """Proposes a known continuation: the first `right` drafts of each cycle are the true
    next tokens, the rest wrong (so acceptance stops there)."""

    def __init__(self, model, prompt, truth, right=5):
        self.model, self.offset0, self.truth, self.right = model, len(prompt), truth, right

    def draft(self, embed, lm_head, anchor, rings, sample=None):
        position = rings[0].offset - self.offset0 + 1   # index in truth after the anchor
        ahead = self.truth[position:position + 5] + [0] * 5
        vocab = self.model.cfg.vocab_size
        drafts = [t if i < self.right else (t + 1) % vocab for i, t in enumerate(ahead[:5])]
        logits = mx.where(mx.arange(vocab)[None] == mx.array(drafts)[:, None], 0.0, -1e9)
        tokens = mx.array([[anchor.item()] + drafts], dtype=mx.int32)
        return tokens, logits[None], mx.full((1, 5), 10.0)


# The confidence test covers the blocks in between; k = 1 (40 cycles) is slow.
@pytest.mark.parametrize("k", [slow(1), 5])
@pytest.mark.slow
def test_greedy_equals_plain_greedy(tiny, k):
    model, prompt = tiny
    plain, plain_cache = plain_run(model, prompt, 40)
    spec, _, cache, stats = speculate(model, prompt, 40, num_draft_tokens=k)
    assert spec == plain
    assert stats.proposed > 0 and stats.cycles == 40 - stats.accepted
    assert same(committed(model, cache), committed(model, plain_cache))


@pytest.mark.parametrize("right", [5, 2, slow(0)])
def test_accepted_drafts_and_rollback(tiny, right):
    """An oracle drafter right about the first `right` drafts of each cycle: exactly those are
    accepted, the output is still plain greedy, and the cache equals the plain run's."""
    model, prompt = tiny
    plain, plain_cache = plain_run(model, prompt, 40)
    oracle = Oracle(model, prompt, plain, right)
    spec, from_draft, cache, stats = speculate(model, prompt, 40, drafter=oracle)
    assert spec == plain
    cycles_expected = -(-40 // (right + 1))
    assert stats.cycles == cycles_expected and stats.accepted == 40 - cycles_expected
    assert sum(from_draft) == stats.accepted
    assert same(committed(model, cache), committed(model, plain_cache))


def test_drafts_shrink_to_fill_the_context_exactly(tiny):
    """Called with more tokens than the context holds, the cycles shrink their drafts near the
    end so every position is used: plain greedy's tokens up to the last position, then the
    context's error (a full cycle of 5 drafts near the end would fail 5 tokens early)."""
    model, prompt = tiny
    plain, _ = plain_run(model, prompt, 40)
    oracle = Oracle(model, prompt, plain, right=5)
    cache = model.make_cache()
    logits = prefill(model, prompt, cache)
    limit, model.cfg.max_position_embeddings = model.cfg.max_position_embeddings, len(prompt) + 23
    tokens = []
    try:
        with pytest.raises(ValueError, match="max_position_embeddings"):
            for token, _, _ in speculative_steps(model, logits, cache, sampling=Sampling(),
                                                 max_tokens=1000, drafter=oracle):
                tokens.append(token)
    finally:
        model.cfg.max_position_embeddings = limit
    assert tokens == plain[:23]


class ConfidentFor(Oracle):
    """An oracle right about every draft whose confidences are sigmoid^-1 of `p`."""

    def __init__(self, model, prompt, truth, p):
        super().__init__(model, prompt, truth)
        self.conf = mx.log(mx.array([p]) / (1 - mx.array([p])))

    def draft(self, *args, **kwargs):
        tokens, logits, _ = super().draft(*args, **kwargs)
        return tokens, logits, self.conf


@pytest.mark.parametrize("threshold,k", [(0.5, 2), (0.85, 1), (0.95, 0), (0.1, 3), (0.01, 4)])
@pytest.mark.slow
def test_confidence_schedule_verifies_the_surviving_prefix(tiny, threshold, k):
    """Running products 0.9, 0.81, 0.405, 0.0405, 0.004: a threshold verifies exactly the drafts
    whose product stays above it (all right, so all accepted), and the output is plain greedy."""
    model, prompt = tiny
    plain, _ = plain_run(model, prompt, 20)
    drafter = ConfidentFor(model, prompt, plain, [0.9, 0.9, 0.5, 0.1, 0.1])
    spec, _, _, stats = speculate(model, prompt, 20, drafter=drafter, draft_confidence=threshold)
    assert spec == plain
    assert stats.cycles == -(-20 // (k + 1)) and stats.accepted == 20 - stats.cycles
    assert stats.proposed == stats.accepted


@pytest.mark.slow
def test_every_cycle_leaves_the_plain_cache(tiny):
    """After each cycle (checked at every yielded anchor) the cache equals a plain run's cache
    over the same committed tokens."""
    model, prompt = tiny
    plain, _ = plain_run(model, prompt, 18)
    cache = model.make_cache()
    logits = prefill(model, prompt, cache)
    oracle = Oracle(model, prompt, plain, 2)
    for token, _, from_draft in speculative_steps(model, logits, cache, sampling=Sampling(),
                                                  max_tokens=18, drafter=oracle):
        if from_draft:
            continue
        reference = model.make_cache()
        prefill(model, prompt + plain[:cache[0].offset - len(prompt)], reference)
        assert same(committed(model, cache), committed(model, reference))


def test_stop_token_inside_accepted_drafts_ends_the_reply(tiny):
    model, prompt = tiny
    plain, _ = plain_run(model, prompt, 20)
    stop = plain[7]
    first = plain.index(stop)
    spec, _, cache, _ = speculate(model, prompt, 20, drafter=Oracle(model, prompt, plain),
                                  stops=[stop])
    assert spec == plain[:first + 1]
    assert cache[0].offset == len(prompt) + first + 1


@pytest.mark.slow
def test_sampling_commits_what_a_plain_forward_holds(tiny):
    """Temperature 1: whatever is committed, the cache equals a plain prefill of it."""
    model, prompt = tiny
    mx.random.seed(3)
    spec, _, cache, stats = speculate(model, prompt, 24, sampling=Sampling(temp=1.0, top_p=0.9))
    reference = model.make_cache()
    prefill(model, prompt + spec, reference)
    assert len(spec) == 24 and stats.cycles > 0
    assert same(committed(model, cache), committed(model, reference))


def _wrong_accept(sampling, targets, drafts, q):
    """A deliberately wrong rule (accept whenever p >= q, else draw from p): the test of the
    statistical test."""
    p = mx.exp(sampling.logprobs(targets))
    for r, token in enumerate(drafts):
        if p[r, token].item() < mx.exp(q[r, token]).item():
            return drafts[:r], mx.random.categorical(mx.log(p[r])).item()
    return drafts, mx.random.categorical(mx.log(p[len(drafts)])).item()


def _emitted(accept, p, q, trials):
    """First and second emitted tokens of `trials` verify cycles on fixed distributions."""
    sampling = Sampling(temp=1.0)
    targets, proposal = mx.log(mx.array(p)), mx.log(mx.array(q))
    firsts, seconds = [], []
    for _ in range(trials):
        drafts = [mx.random.categorical(proposal[r]).item() for r in range(2)]
        accepted, following = accept(sampling, targets, drafts, proposal)
        emitted = accepted + [following]
        firsts.append(emitted[0])
        if accepted:
            seconds.append(emitted[1])
    return np.array(firsts), np.array(seconds)


def _chi2(samples, p) -> float:
    counts = np.bincount(samples, minlength=len(p))
    expected = len(samples) * np.asarray(p)
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.slow
def test_rejection_sampling_is_distributed_as_the_target():
    """First emitted token ~ p_0, and after an accepted first draft the second ~ p_1, within
    a chi-square bound (p = 0.001) over 3000 seeded cycles; the wrong rule fails it."""
    p = [[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]]
    q = [[0.4, 0.3, 0.2, 0.1], [0.1, 0.1, 0.1, 0.7]]
    mx.random.seed(0)
    firsts, seconds = _emitted(_accept, p, q, 3000)
    assert _chi2(firsts, p[0]) < CHI2_DF3_P001
    assert _chi2(seconds, p[1]) < CHI2_DF3_P001
    mx.random.seed(0)
    firsts, seconds = _emitted(_wrong_accept, p, q, 3000)
    assert max(_chi2(firsts, p[0]), _chi2(seconds, p[1])) > 5 * CHI2_DF3_P001


def test_bad_settings_are_refused(tiny):
    model, _ = tiny
    for k in (0, 6, 2.5):
        with pytest.raises(ValueError, match="num_draft_tokens must be an int in 1..5"):
            check_draft_settings(model, None, k)
    with pytest.raises(ValueError, match="mlx_v41.Sampling"):
        check_draft_settings(model, lambda x: x, 5)
    plain = mlx_v41.load_model(golden_checkpoint("tiny"), dspark=False)
    with pytest.raises(ValueError, match="loaded without it"):
        check_draft_settings(plain, None, 5)
    cache = plain.make_cache()
    logits = prefill(plain, [1, 2, 3], cache)
    with pytest.raises(ValueError, match="loaded without it"):  # called directly, no drafter
        next(speculative_steps(plain, logits, cache, sampling=Sampling(), max_tokens=2))
    assert cache[0].offset == 3


def test_batch_is_refused_in_one_line(tiny):
    """Drafting runs one sequence per cache: a batch is refused, not silently cut to row 0."""
    model, prompt = tiny
    cache = model.make_cache()
    logits = model(mx.array([prompt[:8], prompt[8:16]]), cache=cache)
    with pytest.raises(ValueError, match="one sequence per cache: logits have batch 2"):
        next(speculative_steps(model, logits, cache, sampling=Sampling(), max_tokens=4))
    tokenizer = load_tokenizer(golden_checkpoint("tiny"))
    with pytest.raises(ValueError, match=r"one sequence: prompt has shape \[2, 8\]"):
        next(mlx_v41.stream_generate(model, tokenizer, mx.array([prompt[:8], prompt[8:16]]),
                                     draft="dspark"))
    one = mlx_v41.generate(model, tokenizer, mx.array([prompt[:8]]), max_tokens=4, draft="dspark")
    assert one == mlx_v41.generate(model, tokenizer, prompt[:8], max_tokens=4)


@pytest.mark.parametrize("right", [5, slow(0)])
@pytest.mark.slow
def test_logits_processors_shape_every_verify_row(tiny, right):
    """Logits processors (mlx-lm's repetition penalty, then one that allows only the token after
    the last one) with drafts equal plain decoding with them: each verify row is shaped with the
    tokens before it, the ones fed earlier in the same verify forward included."""
    from mlx_lm.sample_utils import make_logits_processors

    model, prompt = tiny
    vocab = mx.arange(model.cfg.vocab_size)

    def count_up(tokens, logits):  # allows only the token after the last one fed
        return mx.where(vocab == (tokens[-1] + 1) % model.cfg.vocab_size, logits, -1e9)

    processors = make_logits_processors(repetition_penalty=4.0, repetition_context_size=64)
    processors.append(count_up)
    cache = model.make_cache()
    logits = prefill(model, prompt, cache)
    plain = [t for t, _ in generate_step(model, logits, cache, tokens=prompt,
                                         logits_processors=processors, max_tokens=30)]
    assert plain != plain_run(model, prompt, 30)[0]        # the penalty changes the output
    spec, _, _, stats = speculate(model, prompt, 30, logits_processors=processors,
                                  history=prompt, drafter=Oracle(model, prompt, plain, right))
    assert spec == plain and stats.accepted == (30 - stats.cycles)


@pytest.mark.parametrize("rollback", [None, slow(0), slow(5)])
@pytest.mark.slow
def test_ced_prefill_fills_the_draft_rings(goldens, rollback):
    """The CED halo covers the rows the draft rings need: after an exact CED prefill the rings
    equal a full prefill's, and after the largest trim the cache allows they equal a full
    prefill of the shorter prompt."""
    prompt = goldens("tiny").prompt[:150].tolist()
    ced = mlx_v41.load_model(golden_checkpoint("tiny"), dspark=True, ced_rollback=rollback)
    full = mlx_v41.load_model(golden_checkpoint("tiny"), dspark=True, prefill_mode="full")
    cache = ced.make_cache()
    prefill(ced, prompt, cache, step_size=64)
    reference = full.make_cache()
    prefill(full, prompt, reference)
    assert same(committed(ced, cache), committed(full, reference))
    n = cache[0].max_trim()
    assert n == max(1, ced.ced_rollback)
    mlx_v41.trim_cache(cache, n)
    shorter = full.make_cache()
    prefill(full, prompt[:150 - n], shorter)
    assert same(committed(ced, cache), committed(full, shorter))


def test_prompt_cache_round_trip_keeps_the_rings(tiny, tmp_path):
    """Saved with the drafter, loaded back exactly; a model without it refuses in one line."""
    model, prompt = tiny
    cache = model.make_cache()
    prefill(model, prompt, cache)
    path = tmp_path / "chat.cache"
    mlx_v41.save_prompt_cache(path, cache, model)
    assert same(committed(model, mlx_v41.load_prompt_cache(path, model)), committed(model, cache))
    with pytest.raises(mlx_v41.CacheError, match="same dspark setting"):
        mlx_v41.load_prompt_cache(path, mlx_v41.load_model(golden_checkpoint("tiny"),
                                                            dspark=False))


@pytest.mark.slow
def test_greedy_equals_plain_greedy_on_the_published_schedule(goldens):
    """The 40 + 3 layer schedule (CED prefill with its longer halo, all owner kinds); 20 tokens
    (tiny runs 40) to keep the suite short."""
    model = mlx_v41.load_model(golden_checkpoint("schedule"), dspark=True)
    prompt = goldens("schedule").prompt[:40].tolist()
    cache = model.make_cache()
    logits = prefill(model, prompt, cache)
    plain = [token for token, _ in generate_step(model, logits, cache, max_tokens=20)]
    spec, _, spec_cache, stats = speculate(model, prompt, 20)
    assert spec == plain and stats.proposed > 0
    assert same(committed(model, spec_cache), committed(model, cache))
