"""The prompt thread (`BatchGenerator(prefill_thread=True)`, `mlx_v41.server --prefill-thread`):
prompts are read on a thread of their own while the batch decodes. Every sequence still gets
its batch-1 bits, the pieces run beside the decode forwards (not between them), a prompt
removed while its piece runs leaves its cache as it was, a prompt that fails there fails
alone, and the server serves with it and ends it."""

from __future__ import annotations

import re
import threading
import time
from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

import mlx_v41.generation.batch as batch_module
import mlx_v41.generation.prompt_schedule as prompt_schedule
import mlx_v41.generation.speculative as speculative
from conftest import packed_state
from mlx_v41.generation.batch import BatchGenerator
from mlx_v41.generation.prompt_thread import THREAD_NAME, PromptThread, check_prefill_thread
from mlx_v41.generation.sequence import BatchSequence
from mlx_v41.model.engram import Engram
from mlx_v41.model.prefill import Pieces
from mlx_v41.numerics.rope import shared_rope
import test_batch_schedule as schedule
from test_batch_schedule import STEP, alone, prompts

pytestmark = pytest.mark.usefixtures("cpu")

THREAD = THREAD_NAME
loaded = schedule.loaded  # the fixture: the tiny golden on the reference ops, its drafter too


@pytest.fixture
def spans(monkeypatch) -> dict:
    """(thread name, start, end) of every prompt piece and every batched forward; each chunk
    of a prompt sleeps 30 ms inside its piece (the GIL released), a piece's arithmetic in
    miniature."""
    log = {"pieces": [], "forwards": []}
    serials = {}  # id of a prompt's `Pieces` -> (the object, held so no other takes its id; n)
    run, forward, progress = Pieces.run, batch_module.batch_forward, BatchSequence.progress

    def timed(kind, call, *args):
        tic = time.perf_counter()
        try:
            return call(*args)
        finally:  # and which prompt's `Pieces` (a number per object)
            held = serials.setdefault(id(args[0]), (args[0], len(serials)))
            log[kind].append((threading.current_thread().name, tic, time.perf_counter(),
                              held[1]))

    def slow_progress(self, done, total):
        time.sleep(0.03)
        progress(self, done, total)

    monkeypatch.setattr(BatchSequence, "progress", slow_progress)
    monkeypatch.setattr(Pieces, "run", lambda self, allowance: timed("pieces", run, self,
                                                                      allowance))
    for module in (batch_module, speculative):  # the decode step's and the DSpark verify's
        monkeypatch.setattr(module, "batch_forward",
                            lambda *args: timed("forwards", forward, *args))
    return log


def run_all(generator, out: dict, until=None) -> None:
    for _ in range(2000):
        if not len(generator) or (until is not None and until()):
            return
        for r in generator.next():
            out.setdefault(r.uid, []).append(r)
    raise AssertionError("did not finish within the step limit")


@pytest.mark.slow
@pytest.mark.parametrize("draft", [None, "dspark"])
def test_prompts_read_beside_the_decoding_get_batch_one_tokens(loaded, spans, draft):
    """Two replies decode while a 120-token prompt and then a 9-token one arrive: the long
    prompt's pieces run on the prompt thread, at least one of them while a decode forward runs
    on the main thread; the short one, which fits a step's budget, is read on the main thread
    in the step after it arrives (not behind the long one's piece) and has its first token
    then; every sequence (the long prompt's first logprobs included) gets its batch-1 tokens;
    `close()` ends the thread."""
    model, tokenizer = loaded
    short, (long_,), (late,) = prompts([5, 23]), prompts([120], 1), prompts([9], 2)
    generator = BatchGenerator(model, stop_tokens=(), max_tokens=14, prefill_step_size=STEP,
                               decode_prefill_budget=16, min_prefill_chunk=4,
                               prefill_thread=True, draft=draft)
    out = {}
    try:
        uids = generator.insert(short)
        run_all(generator, out, until=lambda: len(generator.decoding) == 2)
        long_uid = generator.insert([long_])[0]
        run_all(generator, out, until=lambda: any(s.prefilled for s in generator.prefilling))
        late_uid = generator.insert([late], max_tokens=5)[0]
        on_main = {key for name, *_, key in spans["pieces"] if name == "MainThread"}
        for r in generator.next():
            out.setdefault(r.uid, []).append(r)
        assert late_uid in out, "the short prompt waited for the long one"
        assert len(generator.prefilling) == 1, "the long prompt was read before the short one"
        on_main = {key for name, *_, key in spans["pieces"] if name == "MainThread"} - on_main
        run_all(generator, out)
    finally:
        generator.close()
    assert generator.prompt_thread.closed
    assert len(on_main) == 1  # the short prompt's pieces
    assert {name for name, *_, key in spans["pieces"] if key not in on_main} == {THREAD}
    assert {name for name, *_, key in spans["pieces"] if key in on_main} == {"MainThread"}
    assert {name for name, *_ in spans["forwards"]} == {"MainThread"}
    beside = [p for p in spans["pieces"] for f in spans["forwards"]
              if p[1] < f[2] and f[1] < p[2]]
    assert beside, "no prompt piece ran while a decode forward did"
    logits = model.prefill(mx.array([long_]), model.make_cache(), step_size=STEP)
    first = out[long_uid][0]
    if draft is None:
        assert mx.array_equal(first.logprobs, logits[0, -1] - mx.logsumexp(logits[0, -1]))
    assert first.token == mx.argmax(logits[0, -1]).item()
    for uid, text, n in zip([*uids, long_uid, late_uid], [*short, long_, late],
                            [14, 14, 14, 5]):
        expected = alone(model, tokenizer, text, n)
        assert [r.token for r in out[uid]][:len(expected)] == expected, uid


def test_removing_a_prompt_while_its_piece_runs(loaded, spans, monkeypatch):
    """`remove` of a prompt the thread is reading (a prefix cache under it) waits for the
    piece in flight, not for the rest of the job (of 20 pieces here), then returns the cache
    exactly as it was; the reply decoding beside it keeps its batch-1 tokens and nothing more
    is emitted for the removed one."""
    monkeypatch.setattr(prompt_schedule, "JOB_STEPS", 20)
    model, tokenizer = loaded
    (prefix, long_, reply) = prompts([20, 150, 6], seed=3)
    cache = model.make_cache()
    model.prefill(mx.array([prefix]), cache, step_size=STEP)
    mx.eval([c.state for c in cache])
    before = [mx.array(a) for a in packed_state(cache)]
    offsets = [c.offset for c in cache]
    generator = BatchGenerator(model, stop_tokens=(), max_tokens=10, prefill_step_size=STEP,
                               decode_prefill_budget=16, min_prefill_chunk=4,
                               prefill_thread=True)
    out = {}
    try:
        reply_uid = generator.insert([reply])[0]
        run_all(generator, out, until=lambda: bool(generator.decoding))
        long_uid = generator.insert([long_], caches=[cache])[0]
        run_all(generator, out, until=lambda: generator.prompt_thread.busy and
                any(s.prefilled for s in generator.prefilling))
        pieces = len(spans["pieces"])
        returned = generator.remove([long_uid], return_prompt_caches=True)
        # the piece in flight, and one that may have started just before the remove
        assert len(spans["pieces"]) - pieces <= 2, len(spans["pieces"]) - pieces
        run_all(generator, out)
    finally:
        generator.close()
    assert returned[long_uid] is cache
    assert [c.offset for c in cache] == offsets
    for x, y in zip(packed_state(cache), before, strict=True):
        assert mx.array_equal(x, y)
    assert long_uid not in out
    assert [r.token for r in out[reply_uid]] == alone(model, tokenizer, reply, 10)


def test_removing_another_sequence_does_not_wait_for_the_piece(loaded, monkeypatch):
    """While the thread reads a long prompt, `remove` of a decoding reply (a stop string
    matched, a client gone) and of a request still waiting returns at once, not after the
    piece in flight (held here for 3 s); the other reply and the long prompt keep their
    batch-1 tokens and the removed ones emit nothing more."""
    model, tokenizer = loaded
    replies, (long_,), (queued,) = prompts([6, 9]), prompts([150], 3), prompts([7], 4)
    release, run = threading.Event(), Pieces.run

    def held(self, allowance):
        if threading.current_thread().name == THREAD:
            release.wait(timeout=30)
        return run(self, allowance)

    generator = BatchGenerator(model, stop_tokens=(), max_tokens=10, prefill_step_size=STEP,
                               decode_prefill_budget=16, min_prefill_chunk=4,
                               prefill_thread=True, completion_batch_size=3)
    out, timer = {}, threading.Timer(3.0, release.set)
    try:
        kept, dropped = generator.insert(replies)
        run_all(generator, out, until=lambda: len(generator.decoding) == 2)
        monkeypatch.setattr(Pieces, "run", held)
        long_uid = generator.insert([long_])[0]
        run_all(generator, out, until=lambda: generator.prompt_thread.busy)
        waiting_uid = generator.insert([queued])[0]  # no room: it waits
        for r in generator.next():
            out.setdefault(r.uid, []).append(r)
        assert [s.uid for s in generator.waiting] == [waiting_uid]
        emitted = len(out[dropped])
        timer.start()
        tic = time.perf_counter()
        generator.remove([dropped, waiting_uid])
        seconds = time.perf_counter() - tic
        assert not release.is_set() and seconds < 1.0, seconds
        run_all(generator, out)
    finally:
        release.set()
        timer.cancel()
        generator.close()
    assert len(out[dropped]) == emitted and waiting_uid not in out
    assert [r.token for r in out[kept]] == alone(model, tokenizer, replies[0], 10)
    assert [r.token for r in out[long_uid]] == alone(model, tokenizer, long_, 10)


def test_a_prompt_that_fails_on_the_thread_fails_alone(loaded):
    """A prompt the model refuses (a token id past the vocabulary) fails with an "error"
    response naming it; the reply decoding beside it is untouched."""
    model, tokenizer = loaded
    reply, = prompts([6], seed=4)
    generator = BatchGenerator(model, stop_tokens=(), max_tokens=6, prefill_step_size=STEP,
                               prefill_thread=True)
    out = {}
    try:
        reply_uid = generator.insert([reply])[0]
        run_all(generator, out, until=lambda: bool(generator.decoding))
        bad_uid = generator.insert([[5, model.cfg.vocab_size + 3, 7]])[0]
        run_all(generator, out)
    finally:
        generator.close()
    failed, = out[bad_uid]
    assert failed.finish_reason == "error" and "token ids must lie in" in str(failed.error)
    assert [r.token for r in out[reply_uid]] == alone(model, tokenizer, reply, 6)


@pytest.mark.parametrize("length,step", [(40, STEP), (150, 128)])
def test_the_thread_reads_a_prompt_in_short_evaluations(loaded, monkeypatch, length, step):
    """On the prompt thread a forward is evaluated a few operations at a time, inside every
    layer (MLX's limit on tasks in flight is shared by all streams, so a long evaluation there
    would make each dispatch of the decode step wait); the logits and cache are the ones of
    one evaluation per mHC side on the main thread. Pieces of 128 tokens: the thread runs
    their Sinkhorn in NumPy, the main thread in compiled MLX ops."""
    model, _ = loaded
    ids, = prompts([length], seed=5)
    evaluations, evaluate = [], mx.eval

    def counting(*args):
        evaluations.append(threading.current_thread().name)
        return evaluate(*args)

    def read() -> tuple:
        cache = model.make_cache()
        logits = model.prefill(mx.array([ids]), cache, step_size=step)
        state = packed_state(cache)
        evaluate(logits, state)  # computed where they were made (the thread's stream)
        return logits, state

    monkeypatch.setattr(mx, "eval", counting)
    main = read()
    on_main = len(evaluations)
    thread = PromptThread(model.kernels)
    thread.submit(read)
    (on_thread, _), = [thread.collect(wait=True)]
    thread.close()
    assert set(evaluations[on_main:]) == {THREAD}
    # attention three times and the MoE twice per layer, at least one layer per chunk
    assert len(evaluations) - 2 * on_main >= 5 * model.cfg.num_hidden_layers, \
        (on_main, len(evaluations) - on_main)
    assert mx.array_equal(on_thread[0], main[0])
    for x, y in zip(on_thread[1], main[1], strict=True):
        assert mx.array_equal(x, y)


# Primitives that dispatch no work of their own on the CPU (views and shape changes).
VIEWS = {"Reshape", "Slice", "Broadcast", "ExpandDims", "Squeeze", "Transpose", "AsStrided",
         "Depends", "StopGradient", "Split"}
IN_FLIGHT_OPS = 100  # MLX's limit on tasks in flight: 10 tasks of 10 CPU dispatches


def compute_ops(arrays, path) -> int:
    """How many operations evaluating `arrays` runs, views left out (MLX's graph of what is
    not yet computed, as `mx.export_to_dot` writes it)."""
    mx.export_to_dot(str(path), *[a for _, a in tree_flatten(list(arrays))])
    names = re.findall(r'label ="([^"]*)", shape=rectangle', path.read_text())
    return sum(name not in VIEWS for name in names)


def test_no_evaluation_on_the_thread_fills_the_limit(loaded, monkeypatch, tmp_path):
    """On the prompt thread no evaluation runs more operations than MLX lets be in flight
    (beyond it, each dispatch of the decode step waits for a task of the piece's to end): a
    piece's cache is evaluated a layer at a time at its end (one evaluation of 169 before), an
    index selection's queries before its blocks' scores (111), and an Engram
    layer's rows and projection each on their own, so the projection (a piece's longest
    operation) is not queued among the gate's and the attention input's."""
    model, _ = loaded
    ids, = prompts([150], seed=5)
    sizes, in_engram, evaluate = [], [], mx.eval
    engram_call = Engram.__call__

    def counting(*args):
        if threading.current_thread().name == THREAD:
            sizes.append(compute_ops(args, tmp_path / "graph.dot"))
        return evaluate(*args)

    def engram(self, *args, **kwargs):
        before = len(sizes)
        try:
            return engram_call(self, *args, **kwargs)
        finally:
            in_engram.append(len(sizes) - before)

    def read():
        cache = model.make_cache()
        logits = model.prefill(mx.array([ids]), cache, step_size=128)
        evaluate(logits, packed_state(cache))

    monkeypatch.setattr(mx, "eval", counting)
    monkeypatch.setattr(Engram, "__call__", engram)
    thread = PromptThread(model.kernels)
    thread.submit(read)
    thread.collect(wait=True)
    thread.close()
    assert len(sizes) > 5 * model.cfg.num_hidden_layers
    assert max(sizes) <= IN_FLIGHT_OPS, sorted(sizes)[-5:]
    assert in_engram and min(in_engram) >= 2, in_engram


def test_rotation_tables_are_kept_per_thread():
    """A RoPE keeps the tables it makes for each thread apart: the prompt thread's are made
    lazily on its stream, and the main thread's graph must not read one before that stream
    has computed it (MLX: "There is no Stream(cpu, 1) in current thread")."""
    rope = shared_rope(64, 10000.0)

    def made_there():
        tables = rope.tables((3, 5), 64, False)
        mx.eval(tables)  # to compare them here
        return tables

    thread = PromptThread()
    thread.submit(made_there)
    theirs, _ = thread.collect(wait=True)
    thread.close()
    ours = rope.tables((3, 5), 64, False)
    assert ours is not theirs
    assert ours is rope.tables((3, 5), 64, False)  # kept for this thread
    assert all(mx.array_equal(a, b) for a, b in zip(ours, theirs))


def test_settings_are_checked(loaded):
    model, _ = loaded
    with pytest.raises(ValueError, match="paced schedule"):
        BatchGenerator(model, decode_prefill_budget=None, prefill_thread=True)
    with pytest.raises(ValueError, match="one process"):
        check_prefill_thread(SimpleNamespace(group=object(), expert_store=None), "auto")
    with pytest.raises(ValueError, match="resident experts"):
        check_prefill_thread(SimpleNamespace(group=None, expert_store=object()), "auto")
    thread = PromptThread()
    thread.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):  # a job's own exception reaches the caller
        thread.collect(wait=True)
    thread.close()
    with pytest.raises(RuntimeError, match="closed"):  # the generator's prompts are over
        thread.submit(lambda: None)


@pytest.mark.slow
def test_the_server_reads_prompts_on_the_thread(monkeypatch):
    """`--prefill-thread`'s engine: concurrent chat requests, one with a long prompt, get
    their batch-1 replies, a client that leaves mid-prompt frees the batch, and closing the
    server ends the prompt thread."""
    from server_harness import LiveServer, tiny
    from test_server_batch import chat, expected, words

    model, tokenizer = tiny()
    live = LiveServer(model, tokenizer, max_concurrent=8,
                      batching={"prefill_step_size": STEP, "prefill_thread": True})
    try:
        texts = [words(k, n) for k, n in enumerate([3, 400, 20])]
        results, threads = {}, []
        for k, text in enumerate(texts):
            threads.append(threading.Thread(target=chat, args=(live, text, 8, results, k)))
            threads[-1].start()
            time.sleep(0.05)
        for t in threads:
            t.join()
        for k, text in enumerate(texts):
            assert results[k] == expected(model, tokenizer, text, 8), k
        prompt_thread = live.engine.generator.prompt_thread
        prompt_thread = live.engine.generator.prompt_thread
        assert prompt_thread is not None
    finally:
        live.close()  # the server's shutdown closes the engine, which closes the generator
    assert prompt_thread.closed
