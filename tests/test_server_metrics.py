"""`GET /metrics` (Prometheus' text format, parsed with prometheus_client's parser) and stream
keepalives on `mlx_v41.server` with the tiny golden checkpoint: counters equal the traffic
sent (requests by route and status, tokens, latency histograms), gauges follow a queued and a
prefilling request and are 0 when idle, the serial engine and DSpark drafts, grammar-mask
time, the streamed experts' counters; keepalives (SSE comments, Anthropic pings after
message_start) keep a client with a short read timeout reading through a long prefill."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import anthropic
import httpx2
import pytest
from prometheus_client.parser import text_string_to_metric_families

import mlx_v41
from conftest import golden_checkpoint
from mlx_v41.server.serving import with_keepalives
from server_harness import MODEL_ID, LiveServer, tiny

pytestmark = pytest.mark.usefixtures("cpu")

CHAT = "/v1/chat/completions"
CHAT_OFF = {"chat_template_kwargs": {"thinking": False}}
HELLO = [{"role": "user", "content": "Hello there"}]
SLOW_SECONDS = 1.5  # how late a "slow" request's first token comes
KEEPALIVE_SECONDS = 0.1
READ_TIMEOUT = 0.6  # the clients' read timeout: well under SLOW_SECONDS
EXPERT_BYTES = 13056  # one routed expert of the tiny golden (test_expert_streaming)


class SlowFirstToken:
    """The app's processors hook: a request whose `user` is "slow" gets a processor that
    sleeps on its first call, which the engine makes as the prompt's prefill ends, so the
    client waits as it would for a long prefill."""

    def __init__(self):
        self.is_sleeping = threading.Event()

    def __call__(self, request, prompt):
        if request.user != "slow":
            return []
        calls = []

        def processor(history, logits):
            if not calls:
                self.is_sleeping.set()
                time.sleep(SLOW_SECONDS)
                self.is_sleeping.clear()
            calls.append(history.shape[0])
            return logits
        return [processor]


@pytest.fixture
def live():
    """A fresh server per test: its registry counts only that test's traffic."""
    model, tokenizer = tiny()
    server = LiveServer(model, tokenizer, hook=SlowFirstToken(),
                        keepalive_seconds=KEEPALIVE_SECONDS)
    yield server
    server.close()


def scrape(server, **headers) -> dict:
    """{(sample name, sorted labels): value} of the server's /metrics."""
    reply = httpx2.get(f"http://127.0.0.1:{server.port}/metrics", headers=headers, timeout=30)
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(reply.text) for s in family.samples}


def value(metrics: dict, name: str, **labels) -> float:
    return metrics[(name, tuple(sorted(labels.items())))]


def chat(server, max_tokens: int, **fields) -> dict:
    reply = httpx2.post(f"{server.base_url}/chat/completions", timeout=60, json={
        "model": MODEL_ID, "messages": HELLO, "max_tokens": max_tokens, **CHAT_OFF, **fields})
    assert reply.status_code == 200, reply.text
    return reply.json()


# ----------------------------------------------------------------------------- the counters

def test_counters_equal_the_traffic(live):
    usages = [chat(live, n)["usage"] for n in (2, 3, 4)]
    bad = httpx2.post(f"{live.base_url}/chat/completions", json={"model": MODEL_ID},
                      timeout=30)
    assert bad.status_code == 400
    assert live.wait_idle()
    m = scrape(live)
    assert value(m, "mlx_v41_requests_total", route=CHAT, status="200") == 3
    assert value(m, "mlx_v41_requests_total", route=CHAT, status="400") == 1
    assert value(m, "mlx_v41_request_duration_seconds_count", route=CHAT) == 4
    prompt = sum(u["prompt_tokens"] for u in usages)
    generated = sum(u["completion_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert value(m, "mlx_v41_prompt_tokens_total") == prompt
    assert value(m, "mlx_v41_generation_tokens_total") == generated == 2 + 3 + 4
    assert value(m, "mlx_v41_cached_prompt_tokens_total") == cached > 0  # the same prompt
    assert value(m, "mlx_v41_time_to_first_token_seconds_count") == 3
    assert value(m, "mlx_v41_inter_token_latency_seconds_count") == generated - 3
    assert value(m, "mlx_v41_sequences_finished_total", reason="length") == 3
    # the first prompt was prefilled in full, the others reused it
    assert value(m, "mlx_v41_prompt_cache_misses_total") == 1
    assert value(m, "mlx_v41_prompt_cache_hits_total") == 2
    assert value(m, "mlx_v41_prompt_cache_bytes") == live.store.nbytes > 0
    assert value(m, "mlx_v41_prompt_cache_entries") == len(live.store.entries)


def test_unknown_paths_share_one_label(live):
    for path in ("/nope", "/nope/2"):
        assert httpx2.get(f"http://127.0.0.1:{live.port}{path}").status_code == 404
    m = scrape(live)
    assert value(m, "mlx_v41_requests_total", route="unmatched", status="404") == 2
    assert value(scrape(live), "mlx_v41_requests_total", route="/metrics", status="200") == 1


def test_requests_refused_before_routing_count_under_their_route():
    """A 401 comes from the key check, before the router: it counts under the route."""
    model, tokenizer = tiny()
    server = LiveServer(model, tokenizer, api_keys=("sk-test",))
    try:
        assert httpx2.get(f"{server.base_url}/models").status_code == 401
        assert httpx2.get(f"http://127.0.0.1:{server.port}/metrics").status_code == 401
        m = scrape(server, Authorization="Bearer sk-test")
        assert value(m, "mlx_v41_requests_total", route="/v1/models", status="401") == 1
        assert value(m, "mlx_v41_requests_total", route="/metrics", status="401") == 1
    finally:
        server.close()


@pytest.mark.slow
def test_gauges_follow_a_queued_and_a_prefilling_request(live):
    engine = live.engine
    m = scrape(live)
    assert value(m, "mlx_v41_kv_budget_bytes") == engine.kv_budget
    for name in ("requests_waiting", "sequences_prefilling", "sequences_decoding",
                 "kv_reserved_bytes"):
        assert value(m, f"mlx_v41_{name}") == 0, name
    threads = [threading.Thread(target=chat, args=(live, 2), kwargs={"user": "slow"}),
               threading.Thread(target=chat, args=(live, 2))]
    with engine.lock:  # the worker waits: both requests stay queued
        for t in threads:
            t.start()
        while engine.in_flight < 2:
            time.sleep(0.01)
        m = scrape(live)
        assert value(m, "mlx_v41_requests_waiting") == 2
        assert value(m, "mlx_v41_sequences_prefilling") == 0
    assert live.hook.is_sleeping.wait(10)  # the slow one's prompt is in, its token is not
    m = scrape(live)
    assert value(m, "mlx_v41_sequences_prefilling") >= 1
    assert value(m, "mlx_v41_kv_reserved_bytes") > 0
    for t in threads:
        t.join()
    assert live.wait_idle()
    m = scrape(live)
    for name in ("requests_waiting", "sequences_prefilling", "sequences_decoding",
                 "kv_reserved_bytes"):
        assert value(m, f"mlx_v41_{name}") == 0, name


def test_the_serial_engine_with_dspark():
    """The one-at-a-time engine reports the same counters (no KV budget) and its drafts."""
    model, tokenizer = mlx_v41.load(golden_checkpoint("tiny"), dspark=True)
    server = LiveServer(model, tokenizer, draft="dspark")
    try:
        usage = chat(server, 6)["usage"]
        m = scrape(server)
        assert value(m, "mlx_v41_generation_tokens_total") == usage["completion_tokens"]
        assert value(m, "mlx_v41_time_to_first_token_seconds_count") == 1
        assert not any(name.startswith("mlx_v41_kv_") for name, _ in m)
        proposed = value(m, "mlx_v41_draft_tokens_proposed_total")
        assert proposed == server.engine.counters.drafts_proposed > 0
        assert 0 <= value(m, "mlx_v41_draft_tokens_accepted_total") <= proposed
        assert value(m, "mlx_v41_sequences_decoding") == 0
    finally:
        server.close()


def test_grammar_mask_time(live):
    m = scrape(live)
    assert value(m, "mlx_v41_grammar_mask_seconds_total") == 0
    chat(live, 4, response_format={"type": "json_object"})
    assert value(scrape(live), "mlx_v41_grammar_mask_seconds_total") > 0


def test_streamed_experts_counters():
    model, tokenizer = mlx_v41.load(golden_checkpoint("tiny"), dspark=False,
                                    expert_memory=8 * EXPERT_BYTES)
    server = LiveServer(model, tokenizer)
    try:
        chat(server, 3)
        stats = model.expert_store.stats
        m = scrape(server)
        assert value(m, "mlx_v41_expert_cache_hits_total") == stats.hits
        assert value(m, "mlx_v41_expert_cache_misses_total") == stats.routed - stats.hits > 0
        assert value(m, "mlx_v41_expert_bytes_read_total") == stats.bytes_read > 0
        assert value(m, "mlx_v41_expert_wait_seconds_total") == pytest.approx(
            stats.wait_seconds)
    finally:
        server.close()


def test_resident_experts_have_no_expert_counters(live):
    assert not any(name.startswith("mlx_v41_expert_") for name, _ in scrape(live))


# ----------------------------------------------------------------------------- keepalives

STREAMS = {  # route: a streamed request body (a slow one: its first token comes late)
    "/v1/chat/completions": {"model": MODEL_ID, "messages": HELLO, "max_tokens": 2,
                             "stream": True, "user": "slow", **CHAT_OFF},
    "/v1/completions": {"model": MODEL_ID, "prompt": "Hello", "max_tokens": 2, "stream": True,
                        "user": "slow"},
    "/v1/responses": {"model": MODEL_ID, "input": "Hello", "max_output_tokens": 2,
                      "stream": True, "user": "slow"},
    "/v1/messages": {"model": MODEL_ID, "messages": HELLO, "max_tokens": 2, "stream": True,
                     "metadata": {"user_id": "slow"}},
}


def streamed_lines(server, path: str, body: dict) -> list:
    """The SSE lines of a streamed request read with a READ_TIMEOUT read timeout."""
    timeout = httpx2.Timeout(30, read=READ_TIMEOUT)
    with httpx2.stream("POST", f"http://127.0.0.1:{server.port}{path}", json=body,
                      timeout=timeout) as reply:
        assert reply.status_code == 200
        return list(reply.iter_lines())


@pytest.mark.parametrize("path", list(STREAMS))
@pytest.mark.slow
def test_keepalives_carry_a_short_read_timeout_through_a_long_prefill(live, path):
    lines = streamed_lines(live, path, STREAMS[path])
    if path == "/v1/messages":  # Anthropic's pings, each after message_start
        events = [line.removeprefix("event: ") for line in lines if line.startswith("event:")]
        assert events[0] == "message_start" and events[-1] == "message_stop"
        assert events.count("ping") > 2  # the route's own ping, then keepalives
        assert not any(line.startswith(":") for line in lines)
    else:
        assert lines.count(": keepalive") > 2


@pytest.mark.slow
def test_without_keepalives_the_short_read_timeout_fails():
    model, tokenizer = tiny()
    server = LiveServer(model, tokenizer, hook=SlowFirstToken(), keepalive_seconds=0)
    try:
        with pytest.raises(httpx2.ReadTimeout):
            streamed_lines(server, CHAT, STREAMS[CHAT])
    finally:
        server.close()


@pytest.mark.slow
def test_the_sdks_read_through_a_long_prefill(live):
    timeout = httpx2.Timeout(30, read=READ_TIMEOUT)
    stream = live.client(timeout=timeout).chat.completions.create(
        model=MODEL_ID, messages=HELLO, max_tokens=2, stream=True, user="slow",
        extra_body=CHAT_OFF)
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{live.port}", api_key="unused",
                                 max_retries=0, timeout=timeout)
    with client.messages.stream(model=MODEL_ID, messages=HELLO, max_tokens=2,
                                metadata={"user_id": "slow"}) as stream:
        message = stream.get_final_message()
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 2


@pytest.mark.slow
def test_keepalives_during_a_real_long_prefill():
    """No hook: a long prompt prefilled in small chunks takes longer than the read timeout."""
    model, tokenizer = tiny()
    server = LiveServer(model, tokenizer, keepalive_seconds=KEEPALIVE_SECONDS,
                        batching={"prefill_step_size": 4})
    try:
        words = " ".join(f"w{i % 97}" for i in range(120))
        body = {**STREAMS[CHAT], "messages": [{"role": "user", "content": words}]}
        tic = time.monotonic()
        lines = streamed_lines(server, CHAT, body)
        assert time.monotonic() - tic > READ_TIMEOUT
        assert lines.count(": keepalive") >= 1 and "data: [DONE]" in lines
    finally:
        server.close()


# ----------------------------------------------------------------------------- the wrapper

async def paced(delays: list, log: list):
    try:
        for i, delay in enumerate(delays):
            await asyncio.sleep(delay)
            yield f"event {i}"
    finally:
        log.append("closed")


def test_the_wrapper_keeps_every_event_in_order():
    async def run():
        log = []
        out = [e async for e in with_keepalives(paced([0.0, 0.25, 0.0, 0.12], log), 0.05,
                                                "ka")]
        return out, log
    out, log = asyncio.run(run())
    assert [e for e in out if e != "ka"] == ["event 0", "event 1", "event 2", "event 3"]
    assert out.index("event 1") - out.index("event 0") > 2 and out.count("ka") >= 5
    assert log == ["closed"]


def test_the_wrapper_waits_for_the_first_event_when_asked():
    async def run():
        stream = with_keepalives(paced([0.2, 0.2], []), 0.05, "ka", is_after_first=True)
        return [e async for e in stream]
    out = asyncio.run(run())
    assert out[0] == "event 0" and "ka" in out


def test_closing_the_wrapper_closes_the_stream_it_waits_on():
    async def run():
        log = []
        stream = with_keepalives(paced([0.0, 5.0], log), 0.05, "ka")
        assert await anext(stream) == "event 0"
        assert await anext(stream) == "ka"  # event 1 is awaited in a task
        await stream.aclose()
        await asyncio.sleep(0.01)
        return list(log)  # before asyncio.run cancels what is left
    assert asyncio.run(run()) == ["closed"]


def test_metrics_is_a_documented_route(live):
    schema = json.loads(httpx2.get(f"http://127.0.0.1:{live.port}/openapi.json").text)
    assert "/metrics" in schema["paths"]
