"""Stall-free batch scheduling: a prompt prefilled in paced pieces (chunks sized per step, the
CED halo a few decoder layers at a time) gets the bits of a one-call prefill; while sequences
decode, each step's prompt work stays within its budget and every decoding sequence gets a
token every step; a short prompt behind a long one starts at once; the "auto" budget follows
its measurements; `decode_prefill_budget=None` keeps the old schedule."""

from __future__ import annotations

import math
from typing import NamedTuple

import mlx.core as mx
import numpy as np
import pytest

import mlx_v41
from conftest import golden_checkpoint, packed_state, reference_ops
from mlx_v41.generation.batch import BatchGenerator
from mlx_v41.generation.pacing import PrefillPacer
from mlx_v41.model.prefill import Pieces, prefill_pieces

pytestmark = pytest.mark.usefixtures("cpu")

STEP = 16  # prefill_step_size: the tiny model's window


@pytest.fixture(scope="module")
def loaded():
    model, tokenizer = mlx_v41.load(golden_checkpoint("tiny"))  # with the DSpark drafter
    return reference_ops(model), tokenizer


def prompts(lengths, seed=0) -> list:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 400, n).tolist() for n in lengths]  # below the special tokens


class Piece(NamedTuple):
    pieces: int  # id of the `Pieces` (one prompt)
    allowance: float
    work: float
    is_halo: bool


@pytest.fixture
def pieces(monkeypatch) -> list:
    """Every piece run, in order (a test clears it between steps)."""
    log, original = [], Pieces.run

    def run(self, allowance):
        is_halo = self.pace.in_halo
        output = original(self, allowance)
        log.append(Piece(id(self), allowance, self.pace.done, is_halo))
        return output

    monkeypatch.setattr(Pieces, "run", run)
    return log


def alone(model, tokenizer, prompt, max_tokens) -> list:
    return [r.token for r in mlx_v41.stream_generate(model, tokenizer, prompt,
                                                     max_tokens=max_tokens,
                                                     prefill_step_size=STEP)]


def prefilled(model, ids) -> tuple:
    """A batch-1 one-call prefill: (logits [1, 1, V], cache)."""
    cache = model.make_cache()
    logits = model.prefill(mx.array([ids]), cache, step_size=STEP)
    return logits, cache


@pytest.mark.parametrize("length,allowances", [(150, [7, 1, 13, 5, 2]), (9, [3, 2])])
@pytest.mark.slow
def test_paced_pieces_equal_one_call(loaded, length, allowances):
    """Ragged chunks and the halo in groups of decoder layers give the logits and every cache
    byte (the drafter's rings included) of one `Model.prefill`, and the next decode step's
    logits; a paced call's work adds up to what it announced."""
    model, _ = loaded
    ids, = prompts([length], seed=1)
    expected, reference = prefilled(model, ids)
    cache = model.make_cache()
    steps = prefill_pieces(model, ids, cache, step_size=STEP)
    total, done, halo_pieces, output, i = steps.pace.left, 0.0, 0, None, 0
    while output is None:
        is_halo = steps.pace.in_halo
        output = steps.run(allowances[i % len(allowances)])
        halo_pieces += is_halo
        done += steps.pace.done
        i += 1
    assert halo_pieces >= 3  # 5 decoder layers in at least 3 pieces
    assert math.isclose(done, total) and steps.pace.left == 0
    assert mx.array_equal(output.logits, expected)
    assert [c.offset for c in cache] == [c.offset for c in reference]
    for x, y in zip(packed_state(cache), packed_state(reference), strict=True):
        assert mx.array_equal(x, y)
    step = mx.array([[5]], dtype=mx.int32)
    assert mx.array_equal(model(step, cache=cache), model(step, cache=reference))


def test_halo_in_one_piece_with_no_limit(loaded):
    """An unlimited allowance runs `prefill_step_size` chunks, then the whole halo at once
    (the old schedule's pieces)."""
    model, _ = loaded
    ids, = prompts([70], seed=2)
    expected, _ = prefilled(model, ids)
    steps = prefill_pieces(model, ids, model.make_cache(), step_size=STEP)
    works, output = [], None
    while output is None:
        output = steps.run(math.inf)
        works.append(steps.pace.done)
    assert works[:-1] == [STEP] * 4 + [70 - 4 * STEP]
    assert len(works) == 6  # the halo: one piece
    assert mx.array_equal(output.logits, expected)


def test_closing_pieces_leaves_the_cache(loaded):
    """An abandoned paced prefill (mid-halo) leaves the cache as it was."""
    model, _ = loaded
    ids, = prompts([60], seed=3)
    cache = model.make_cache()
    steps = prefill_pieces(model, ids, cache, step_size=STEP)
    for _ in range(5):  # every chunk and a halo piece
        steps.run(12)
    steps.close()
    assert [c.offset for c in cache] == [0] * len(cache)
    expected, _ = prefilled(model, ids)
    assert mx.array_equal(model.prefill(mx.array([ids]), cache, step_size=STEP), expected)


def steps_until(generator, done, limit=400) -> list:
    """Step until `done(responses of the step)`; every step's responses."""
    out = []
    for _ in range(limit):
        out.append(generator.next())
        if done(out[-1]):
            return out
    raise AssertionError("did not happen within the step limit")


@pytest.mark.slow
def test_decoding_through_a_long_prompt(loaded, pieces):
    """Two replies decode while a 120-token prompt arrives: every step's prompt work stays
    within the budget (a halo layer bigger than what is left waits for the next step), the
    halo runs in several steps, every decoding sequence gets a token every step, and every
    sequence (the long prompt's first logits included) gets its batch-1 bits."""
    model, tokenizer = loaded
    budget, max_tokens = 24, 14
    short, long_ = prompts([5, 23], seed=4), prompts([120], seed=5)[0]
    generator = BatchGenerator(model, stop_tokens=(), max_tokens=max_tokens,
                               prefill_step_size=STEP, decode_prefill_budget=budget,
                               min_prefill_chunk=4)  # a step's rest of its budget is used
    uids = generator.insert(short)
    out = {}

    def record(responses):
        for r in responses:
            out.setdefault(r.uid, []).append(r)

    while len(generator.decoding) < len(short):
        record(generator.next())
    long_uid = generator.insert([long_])[0]
    per_step = []
    while long_uid not in out:
        pieces.clear()
        responses = generator.next()
        record(responses)
        per_step.append((list(pieces), responses))
    assert len(per_step) >= 120 // budget
    halo_steps = 0
    for step, responses in per_step:
        work = sum(p.work for p in step)
        assert work <= budget + 1e-9 or len(step) == 1, step
        halo_steps += any(p.is_halo for p in step)
        assert sorted(r.uid for r in responses if r.uid in uids) == sorted(uids)
    assert generator.step_budget == budget
    assert halo_steps >= 2
    logits, _ = prefilled(model, long_)
    first = out[long_uid][0]
    assert first.token == mx.argmax(logits[0, -1]).item()
    assert mx.array_equal(first.logprobs, logits[0, -1] - mx.logsumexp(logits[0, -1]))
    while len(generator):
        record(generator.next())
    for uid, text in zip([*uids, long_uid], [*short, long_]):
        expected = alone(model, tokenizer, text, max_tokens)  # up to its stop token
        assert [r.token for r in out[uid]][:len(expected)] == expected, uid


@pytest.mark.slow
def test_a_short_prompt_behind_a_long_one_starts_at_once(loaded):
    """A 10-token prompt that arrives while a 300-token prompt is read (replies decoding)
    emits its first token within 2 steps, its prefill included, and its batch-1 tokens."""
    model, tokenizer = loaded
    decoding, long_, late = prompts([6, 11], seed=6), *prompts([300, 10], seed=7)
    generator = BatchGenerator(model, stop_tokens=(), max_tokens=12, prefill_step_size=STEP,
                               decode_prefill_budget=16)
    generator.insert(decoding)
    steps_until(generator, lambda _: len(generator.decoding) == 2)
    generator.insert([long_])
    for _ in range(3):
        generator.next()
    late_uid = generator.insert([late], max_tokens=5)[0]
    emitted = steps_until(generator, lambda rs: any(r.uid == late_uid for r in rs), limit=2)
    assert any(s.uid != late_uid for s in generator.prefilling)  # the long one is still read
    emitted += steps_until(generator, lambda rs: any(r.uid == late_uid and r.finish_reason
                                                     for r in rs))
    tokens = [r.token for rs in emitted for r in rs if r.uid == late_uid]
    assert tokens == alone(model, tokenizer, late, 5)


@pytest.mark.slow
def test_an_interrupted_piece_reads_the_prompt_again(loaded, monkeypatch):
    """Ctrl-C in a halo piece: the prompt's cache is as before it, the prompt waits to be read
    again from its start, the replies' caches are unchanged, and every sequence still gets
    its batch-1 tokens."""
    from mlx_v41.model.model import TextModel

    model, tokenizer = loaded
    short, long_ = prompts([7, 60], seed=11)
    generator = BatchGenerator(model, stop_tokens=(), max_tokens=12, prefill_step_size=STEP,
                               decode_prefill_budget=16)
    uids = generator.insert([short])
    out = {}

    def step():
        for r in generator.next():
            out.setdefault(r.uid, []).append(r.token)

    while not generator.decoding:
        step()
    uids += generator.insert([long_])
    while not any(s.steps is not None and s.steps.pace.in_halo for s in generator.prefilling):
        step()
    seq = generator.prefilling[0]
    replies = [[c.offset for c in s.cache] for s in generator.decoding]

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(TextModel, "decoder_layers", interrupted)
        with pytest.raises(KeyboardInterrupt):
            generator.next()
    assert list(generator.waiting) == [seq] and seq.steps is None
    assert [c.offset for c in seq.cache] == [0] * len(seq.cache)
    assert [[c.offset for c in s.cache] for s in generator.decoding] == replies
    while len(generator):
        step()
    for uid, text in zip(uids, [short, long_]):
        expected = alone(model, tokenizer, text, 12)
        assert out[uid][:len(expected)] == expected, uid


@pytest.mark.slow
def test_the_old_schedule(loaded, pieces):
    """`decode_prefill_budget=None`: `prefill_step_size` chunks round-robin, `prefill_budget`
    tokens per step, the halo in one piece; the same tokens."""
    model, tokenizer = loaded
    texts = prompts([4, 70], seed=8)
    generator = BatchGenerator(model, stop_tokens=(), max_tokens=6, prefill_step_size=STEP,
                               decode_prefill_budget=None)
    uids = generator.insert(texts)
    out, per_step = {}, []
    while len(generator):
        pieces.clear()
        for r in generator.next():
            out.setdefault(r.uid, []).append(r.token)
        per_step.append(list(pieces))
    long_pieces = [p for step in per_step for p in step
                   if p.pieces == per_step[0][-1].pieces]
    assert [p.work for p in long_pieces if not p.is_halo] == [STEP] * 4 + [6]
    assert len([p for p in long_pieces if p.is_halo]) == 1
    for step in per_step:  # chunks start while fewer than prefill_budget rows were read
        rows = [p.work for p in step if not p.is_halo]
        assert sum(rows[:-1]) < STEP
    for uid, text in zip(uids, texts):
        assert out[uid] == alone(model, tokenizer, text, 6)


def test_auto_budget_follows_the_measurements():
    pacer = PrefillPacer("auto", 32, 2048)
    assert pacer.budget() == 32  # nothing measured
    pacer.prefilled(1000, 5.0)  # 5 ms per prompt token
    assert pacer.budget() == 32
    pacer.decoded(1.0)
    assert pacer.budget() == 200  # one decode step's time of prompt work
    pacer.decoded(0.01)  # a running mean: 0.75 * 1.0 + 0.25 * 0.01
    assert pacer.budget() == int(0.7525 / 0.005)
    for _ in range(40):
        pacer.decoded(100.0)
    assert pacer.budget() == 2048
    pacer.prefilled(0, 3.0)  # no prompt work: no rate
    assert pacer.budget() == 2048
    assert PrefillPacer(64, 32, 2048).budget() == 64


def test_auto_budget_in_a_batch(loaded, pieces):
    """The default ("auto") budget lies within [min_prefill_chunk, prefill_step_size] while
    sequences decode, and an idle generator reads `prefill_budget` per step."""
    model, _ = loaded
    generator = BatchGenerator(model, stop_tokens=(), max_tokens=30, prefill_step_size=64,
                               min_prefill_chunk=8)
    generator.insert(prompts([150], seed=9))
    generator.next()
    assert generator.step_budget == 64 and pieces[0].work == 64  # idle: one whole chunk
    steps_until(generator, lambda _: generator.decoding)
    generator.insert(prompts([120], seed=10))
    for _ in range(6):
        generator.next()
        assert 8 <= generator.step_budget <= 64


def test_settings_are_checked(loaded):
    model, _ = loaded
    for bad in (0, -5, "fast", 2.5):
        with pytest.raises(ValueError, match="decode_prefill_budget"):
            BatchGenerator(model, decode_prefill_budget=bad)
    with pytest.raises(ValueError, match="min_prefill_chunk"):
        BatchGenerator(model, min_prefill_chunk=0)
