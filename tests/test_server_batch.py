"""The batching server: concurrent requests of different lengths decode in one batch and each
reply equals its batch-1 reply (greedy and seeded); a long prompt is read chunk by chunk while
the others stream; a short request behind it starts first; a client that leaves mid-prompt
frees the worker at the next chunk; a failing request fails alone; the KV budget queues what
does not fit and refuses what never can; `--max-prompt-tokens`; a bounded load test with random
disconnects; Ctrl-C during a long prefill."""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import mlx.core as mx
import mlx_v41
from conftest import golden_checkpoint, slow
from mlx_v41.server.processors import base_fields, processors_from
from server_harness import (MODEL_ID, Forcing, LiveServer, post, tiny,
                            write_swa_checkpoint)

pytestmark = pytest.mark.usefixtures("cpu")

CHAT_OFF = {"chat_template_kwargs": {"thinking": False}}
STEP = 16  # prefill chunk of these servers: long prompts take many


def words(k: int, n: int) -> str:
    rng = random.Random(k)
    return " ".join(rng.choice(["red", "blue", "cat", "tree", "sky", "nine", "go"])
                    for _ in range(n))


def expected(model, tokenizer, text: str, max_tokens: int, seed=None, temp=0.0) -> tuple:
    """(text, completion tokens) of a batch-1 `stream_generate` of the chat prompt."""
    from mlx_lm.sample_utils import make_sampler

    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                        enable_thinking=False)
    if seed is not None:
        mx.random.seed(seed)
    # a chat reply's processors: its special tokens are masked (which changes what a seeded
    # sampler draws even where the masked tokens would not have won)
    processors = processors_from(base_fields(True), tokenizer)
    responses = list(mlx_v41.stream_generate(model, tokenizer, ids, max_tokens=max_tokens,
                                             sampler=make_sampler(temp),
                                             logits_processors=processors))
    return "".join(r.text for r in responses), len(responses)


@pytest.fixture(scope="module")
def live():
    model, tokenizer = tiny()
    server = LiveServer(model, tokenizer, hook=Forcing(tokenizer), max_concurrent=32,
                        batching={"prompt_concurrency": 4, "prefill_step_size": STEP})
    yield server
    server.close()


def chat(live, text, max_tokens, results, key, **extra):
    client = live.client()
    reply = client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": text}], max_tokens=max_tokens,
        extra_body=CHAT_OFF, **extra)
    results[key] = (reply.choices[0].message.content, reply.usage.completion_tokens)


@pytest.mark.slow
def test_concurrent_requests_batch_and_equal_batch_one(live):
    model, tokenizer = tiny()
    texts = [words(k, n) for k, n in enumerate([1, 6, 30, 90, 3, 45])]
    seeds = [None, None, None, 11, 12, 13]
    results, threads = {}, []
    live.engine.peak_batch = 0
    for k, (text, seed) in enumerate(zip(texts, seeds)):
        extra = {} if seed is None else {"seed": seed, "temperature": 1.0}
        threads.append(threading.Thread(target=chat, args=(live, text, 12, results, k),
                                        kwargs=extra))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert live.engine.peak_batch > 1  # they did run together
    for k, (text, seed) in enumerate(zip(texts, seeds)):
        want = expected(model, tokenizer, text, 12, seed, 0.0 if seed is None else 1.0)
        assert results[k] == want, k


@pytest.mark.slow
def test_short_request_behind_a_long_prompt_starts_first(live):
    """A 600-token prompt takes ~38 chunks; a short request sent just after it is answered
    (whole) while the long one is still being read."""
    long_text, done = words(100, 600), {}

    def long_request():
        chat(live, long_text, 2, done, "long")
        done["long_at"] = time.monotonic()

    thread = threading.Thread(target=long_request)
    thread.start()
    while not live.engine.running:
        time.sleep(0.005)
    chat(live, "hi", 2, done, "short")
    short_at = time.monotonic()
    thread.join()
    assert short_at < done["long_at"]
    model, tokenizer = tiny()
    assert done["long"] == expected(model, tokenizer, long_text, 2)


def test_a_client_that_leaves_mid_prompt_frees_the_worker(live):
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=30)
    body = {"messages": [{"role": "user", "content": words(7, 3000)}], "max_tokens": 5,
            "stream": True, **CHAT_OFF}
    steps = live.engine.steps
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    while live.engine.steps < steps + 3:  # a few chunks of ~190 are in
        time.sleep(0.005)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    assert live.wait_idle(10)
    assert live.engine.last_finish.reason == "cancelled"
    assert live.engine.steps < steps + 60  # it stopped long before the prompt's end
    assert not live.engine.generator.sequences


@pytest.mark.slow
def test_a_failing_request_fails_alone(live):
    model, tokenizer = tiny()
    live.hook.scripts["boom"] = RuntimeError("processor broke")
    results, errors = {}, []

    def failing():
        try:
            chat(live, "explode", 5, results, "bad", user="boom")
        except Exception as e:  # noqa: BLE001 - the 500 is the point
            errors.append(e)

    threads = [threading.Thread(target=chat, args=(live, words(3, 40), 10, results, "good")),
               threading.Thread(target=failing)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 1 and "processor broke" in str(errors[0])
    assert results["good"] == expected(model, tokenizer, words(3, 40), 10)


@pytest.mark.slow
def test_the_kv_budget_queues_and_refuses():
    """A budget for one request at a time: two concurrent ones run one after the other, both
    right; one that could never fit gets a 400 naming max_tokens."""
    from mlx_v41.model.memory import session_bytes

    model, tokenizer = tiny()
    budget = session_bytes(model.cfg, 400)
    server = LiveServer(model, tokenizer, batching={"kv_budget": budget},
                        max_prompt_tokens=200)
    try:
        results = {}
        threads = [threading.Thread(target=chat, args=(server, words(k, 20), 8, results, k))
                   for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert server.engine.peak_batch == 1
        for k in range(2):
            assert results[k] == expected(model, tokenizer, words(k, 20), 8)
        status, reply = post(server.port, "/v1/completions",
                             {"prompt": "hello", "max_tokens": 1000})
        assert status == 400 and reply["error"]["param"] == "max_tokens"
        assert "--kv-budget" in reply["error"]["message"]
        status, reply = post(server.port, "/v1/completions",
                             {"prompt": words(1, 300), "max_tokens": 2})
        assert status == 400 and "--max-prompt-tokens" in reply["error"]["message"]
        assert reply["error"]["param"] == "prompt"
        assert server.wait_idle() and server.engine.in_flight == 0
    finally:
        server.close()


@pytest.mark.parametrize("clients,requests", [slow(16, 64)])
def test_load_with_random_disconnects(tmp_path, clients, requests):
    """`requests` requests from `clients` concurrent clients, about a third dropped mid-reply;
    every completed reply equals its batch-1 greedy reply and the server ends healthy. Stops by
    itself: each client runs a fixed list."""
    model, tokenizer = mlx_v41.load(write_swa_checkpoint(tmp_path / "hf"))
    texts = [words(k, 5 + 17 * (k % 7)) for k in range(8)]
    want = {k: expected(model, tokenizer, texts[k], 16) for k in range(8)}
    server = LiveServer(model, tokenizer, max_concurrent=64)
    errors, completed, dropped = [], [0], [0]
    rng = random.Random(0)
    plans = [[(rng.randrange(8), rng.random() < 0.35) for _ in range(requests // clients)]
             for _ in range(clients)]

    def client_loop(plan):
        for k, drop in plan:
            try:
                if drop:
                    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
                    body = {"messages": [{"role": "user", "content": texts[k]}],
                            "max_tokens": 16, "stream": True, **CHAT_OFF}
                    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                                 {"Content-Type": "application/json"})
                    conn.getresponse().readline()
                    conn.sock.shutdown(socket.SHUT_RDWR)
                    conn.close()
                    dropped[0] += 1
                    continue
                results = {}
                chat(server, texts[k], 16, results, 0)
                if results[0] != want[k]:
                    errors.append((k, results[0], want[k]))
                completed[0] += 1
            except Exception as e:  # noqa: BLE001 - collected and reported
                errors.append(e)

    threads = [threading.Thread(target=client_loop, args=(plan,)) for plan in plans]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        assert not any(t.is_alive() for t in threads)
        assert not errors, errors[:3]
        assert completed[0] + dropped[0] == requests and dropped[0] > 0
        assert server.engine.peak_batch > 1
        assert server.wait_idle(10) and not server.engine.generator.sequences
        results = {}
        chat(server, texts[0], 16, results, 0)
        assert results[0] == want[0]
    finally:
        server.close()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_during_a_long_prefill_exits_quickly(tmp_path, sig):
    """SIGINT or SIGTERM while a long prompt is being read: the server is gone within 5 s
    (a drain ends a request whose reply has not begun at once: at its next chunk)."""
    port = _free_port()
    command = [sys.executable, "-m", "mlx_v41.server", "--model",
               str(golden_checkpoint("tiny")), "--port", str(port), "--prefill-step-size",
               "16"]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 120
        while True:  # it listens at once and loads the model after: /health says when
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline and server.poll() is None
            time.sleep(0.2)
        body = {"prompt": words(5, 6000), "max_tokens": 2}
        thread = threading.Thread(target=lambda: _quiet_post(port, body), daemon=True)
        thread.start()
        time.sleep(2.0)  # the prompt is being read (it would take minutes)
        assert server.poll() is None
        tic = time.monotonic()
        server.send_signal(sig)
        server.wait(timeout=10)
        assert time.monotonic() - tic < 5.0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _quiet_post(port, body):
    try:
        post(port, "/v1/completions", body, timeout=60)
    except Exception:  # noqa: BLE001 - the server goes away mid-request: that is the test
        pass


@pytest.mark.slow
def test_n_choices_share_one_prefill(live):
    """`n` = 3 with a seed: one prefill, three choices, choice i equal to a request with seed +
    i, in chat (streamed and not) and completions; usage counts the prompt once."""
    model, tokenizer = tiny()
    client = live.client()
    text, seed = words(21, 50), 40
    prompt_tokens = live.engine.generator.counters.prompt_tokens
    reply = client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": text}], max_tokens=6, n=3,
        seed=seed, temperature=1.0, extra_body=CHAT_OFF)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                        enable_thinking=False)
    assert live.engine.generator.counters.prompt_tokens - prompt_tokens <= len(ids)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    singles = [expected(model, tokenizer, text, 6, seed + i, 1.0) for i in range(3)]
    assert [(c.message.content) for c in reply.choices] == [t for t, _ in singles]
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.usage.completion_tokens == sum(n for _, n in singles)
    stream = client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": text}], max_tokens=6, n=3,
        seed=seed, temperature=1.0, stream=True, stream_options={"include_usage": True},
        extra_body=CHAT_OFF)
    texts, usage = ["", "", ""], None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
        usage = chunk.usage or usage
    assert texts == [t for t, _ in singles]
    assert usage.completion_tokens == reply.usage.completion_tokens
    completion = client.completions.create(model=MODEL_ID, prompt=text, max_tokens=4, n=2)
    assert [c.index for c in completion.choices] == [0, 1]
    assert completion.choices[0].text == completion.choices[1].text  # greedy: the same


@pytest.mark.slow
def test_dspark_requests_batch_and_equal_batch_one():
    """With --dspark the batching engine drafts for every request: two concurrent greedy
    requests run in one batch and each gets its batch-1 DSpark reply."""
    from mlx_v41.server.engine.batch import BatchEngine

    model, tokenizer = mlx_v41.load(golden_checkpoint("tiny"), dspark=True)
    server = LiveServer(model, tokenizer, batching={"draft": "dspark", "num_draft_tokens": 3,
                                                    "prefill_step_size": STEP})
    try:
        assert isinstance(server.engine, BatchEngine) and server.engine.generator.draft
        texts, results = [words(31, 4), words(32, 40)], {}
        threads = [threading.Thread(target=chat, args=(server, text, 10, results, k))
                   for k, text in enumerate(texts)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert server.engine.peak_batch > 1
        assert server.engine.generator.counters.drafts_proposed > 0
    finally:
        server.close()
    for k, text in enumerate(texts):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            enable_thinking=False)
        responses = list(mlx_v41.stream_generate(
            model, tokenizer, ids, max_tokens=10, draft="dspark", num_draft_tokens=3,
            logits_processors=processors_from(base_fields(True), tokenizer)))
        assert results[k] == ("".join(r.text for r in responses), len(responses)), k


def test_the_serial_engine_also_stops_a_prompt_whose_client_left():
    """--serial: the prompt stops at the next chunk too, and nothing is kept of it."""
    model, tokenizer = tiny()
    server = LiveServer(model, tokenizer, serial=True)
    server.engine.prefill_step_size = STEP
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        body = {"messages": [{"role": "user", "content": words(8, 3000)}], "max_tokens": 5,
                "stream": True, **CHAT_OFF}
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        while not server.engine.in_flight:
            time.sleep(0.005)
        time.sleep(0.5)  # a few chunks of ~190 are in
        tic = time.monotonic()
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        assert server.wait_idle(10)
        assert time.monotonic() - tic < 5
        assert server.engine.last_finish.reason == "cancelled"
        assert server.store.nbytes == 0  # nothing of the abandoned prompt was kept
    finally:
        server.close()


def test_a_failed_step_fails_its_requests_and_the_server_goes_on(live):
    """A step that raises (every cache is left as it was) fails the requests in it with a 500;
    the next request is served as usual."""
    model, tokenizer = tiny()
    generator = live.engine.generator
    real = generator.next
    calls = []

    def broken():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("step broke")
        return real()

    generator.next = broken
    try:
        status, reply = post(live.port, "/v1/completions", {"prompt": "hello", "max_tokens": 4})
    finally:
        del generator.next
    assert status == 500 and "step broke" in reply["error"]["message"]
    results = {}
    chat(live, words(2, 10), 5, results, 0)
    assert results[0] == expected(model, tokenizer, words(2, 10), 5)
    assert not generator.sequences
