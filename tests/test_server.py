"""`mlx_v41.server` live on 127.0.0.1 with the tiny golden checkpoint, driven by the real `openai`
client and raw HTTP: chat (streamed and not), completions, models; greedy output equal to
`mlx_v41.generate`; usage; DSML tool calls forced on the real model; bad input; a failing
request; cancellation; 429 past the bound; the load test."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time

import openai
import pytest

import mlx_v41
from mlx_v41.server.engine import Settings
from server_harness import MODEL_ID, Forcing, LiveServer, get, one_past_the_bound, post, tiny

pytestmark = pytest.mark.usefixtures("cpu")

CHAT_OFF = {"chat_template_kwargs": {"thinking": False}}


@pytest.fixture(scope="module")
def live():
    model, tokenizer = tiny()
    hook = Forcing(tokenizer)
    server = LiveServer(model, tokenizer, hook=hook)
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(live):
    return live.client()


def reference(messages, max_tokens, thinking=False, tools=None):
    """(text, tokens, prompt length) of `mlx_v41.generate`'s greedy run on the same chat."""
    model, tokenizer = tiny()
    ids = tokenizer.apply_chat_template(messages, tools=tools, enable_thinking=thinking)
    responses = list(mlx_v41.stream_generate(model, tokenizer, ids, max_tokens=max_tokens))
    return "".join(r.text for r in responses), [r.token for r in responses], len(ids)


# ----------------------------------------------------------------------------- basic endpoints

def test_health_and_models(live, client):
    assert get(live.port, "/health") == (200, {"status": "ok", "model": MODEL_ID})
    assert [m.id for m in client.models.list()] == [MODEL_ID]


def test_chat_greedy_equals_generate_with_usage(client):
    messages = [{"role": "user", "content": "Hello there"}]
    text, tokens, prompt_length = reference(messages, 6)
    reply = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=6,
                                           extra_body=CHAT_OFF)
    choice = reply.choices[0]
    assert choice.message.content == text and choice.finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens,
            reply.usage.total_tokens) == (prompt_length, len(tokens), prompt_length + len(tokens))


def test_streamed_thinking_reply_is_reasoning(client):
    messages = [{"role": "user", "content": "Think about it"}]
    text, tokens, prompt_length = reference(messages, 5, thinking=True)
    stream = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=5,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert reasoning == "".join(getattr(d, "reasoning", None) or "" for d in deltas) == text
    assert not "".join(d.content or "" for d in deltas)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.prompt_tokens == prompt_length
    assert chunks[-1].usage.completion_tokens == len(tokens)


def test_completions_and_logprobs(live, client):
    model, tokenizer = tiny()
    ids = tokenizer.encode_prompt("Once upon")
    responses = list(mlx_v41.stream_generate(model, tokenizer, ids, max_tokens=4))
    reply = client.completions.create(model=MODEL_ID, prompt="Once upon", max_tokens=4,
                                      logprobs=2)
    choice = reply.choices[0]
    assert choice.text == "".join(r.text for r in responses)
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == 4
    expected = [r.logprobs[r.token].item() for r in responses]
    assert choice.logprobs.token_logprobs == pytest.approx(expected, abs=1e-5)
    for top, r in zip(choice.logprobs.top_logprobs, responses):  # greedy: the best is chosen
        assert max(top.values()) == pytest.approx(r.logprobs.max().item(), abs=1e-5)
    streamed = client.completions.create(model=MODEL_ID, prompt="Once upon", max_tokens=4,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == choice.text


def test_stop_string_ends_the_reply(client):
    messages = [{"role": "user", "content": "Hello there"}]
    text, _, _ = reference(messages, 6)
    stop = text[2:4]
    reply = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=6,
                                           stop=[stop], extra_body=CHAT_OFF)
    assert reply.choices[0].message.content == text[:text.index(stop)]
    assert reply.choices[0].finish_reason == "stop"


# ----------------------------------------------------------------------------- bad input

BAD_BODIES = [
    (b'{"messages": [', 400, None, "not valid JSON"),
    ({"messages": "hi"}, 400, "messages", "valid list"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"}, 400, "max_tokens",
     "valid integer"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}, 400, "max_tokens",
     "greater than or equal to 1"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400,
     "temperature", "valid number"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream": 1}, 400, "stream",
     "valid boolean"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role", "'system'"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-9"}, 404, "model",
     "does not exist"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, 400,
     "messages[0].content[0]", "not an image"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, 400,
     "tool_choice", "needs tools"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 17}, 400, "n", "at most 16"),
    ({"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "huge"}, 400,
     "reasoning_effort", "reasoning_effort"),
    # json.dumps writes NaN / Infinity, which Python's JSON reader (the server's) accepts
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": float("nan")}, 400,
     "temperature", "finite number"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": float("inf")}, 400,
     "temperature", "finite number"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": float("nan")}, 400, "top_p",
     "finite number"),
    ({"messages": [{"role": "user", "content": "hi"}], "seed": -2**63 - 1}, 400, "seed",
     "greater than or equal to -9223372036854775808"),
    ({"messages": [{"role": "user", "content": "hi"}], "seed": 2**64}, 400, "seed",
     "less than or equal to 18446744073709551615"),
    # JSON's "\ud800" escape: a lone surrogate, which no UTF-8 text holds
    ({"messages": [{"role": "user", "content": "hi \ud800"}]}, 400, "messages[0].content",
     "lone surrogate U+D800 at character 3 is not valid text"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}, 400,
     "messages[0].content[0].text", "lone surrogate U+DFFF"),
]


@pytest.mark.parametrize("body, status, param, words", BAD_BODIES)
def test_bad_input_is_an_openai_error(live, body, status, param, words):
    code, reply = post(live.port, "/v1/chat/completions", body)
    assert code == status
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"} and words in error["message"]
    assert error["param"] == param and "\n" not in error["message"]


def test_bad_input_through_openai_and_the_next_request_works(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="not an image"):
        client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    reply = client.completions.create(model=MODEL_ID, prompt="ok", max_tokens=1)
    assert reply.usage.completion_tokens == 1


def test_lone_surrogates_in_completions_and_the_next_request_works(live, client):
    """Sent raw: the `openai` client cannot encode a lone surrogate itself."""
    code, reply = post(live.port, "/v1/completions", {"prompt": "a\ud800", "max_tokens": 1})
    assert code == 400 and reply["error"]["param"] == "prompt"
    assert reply["error"]["message"] == \
        "prompt: lone surrogate U+D800 at character 1 is not valid text"
    code, reply = post(live.port, "/v1/completions", b'{"prompt": "ok \\ud83d\\ude00", '
                                                     b'"max_tokens": 1}')
    assert code == 200 and reply["usage"]["completion_tokens"] == 1  # a pair is one character
    reply = client.completions.create(model=MODEL_ID, prompt="ok", max_tokens=1, seed=2**64 - 1)
    assert reply.usage.completion_tokens == 1


def test_a_failing_request_leaves_the_server_healthy(live, client):
    live.hook.scripts["boom"] = RuntimeError("boom in a processor")
    entries = [(e.state.tokens, e.nbytes) for e in live.store.entries]
    with pytest.raises(openai.InternalServerError, match="boom in a processor"):
        client.chat.completions.create(model=MODEL_ID, messages=[
            {"role": "user", "content": "fail, please"}], user="boom", max_tokens=3)
    stream = client.chat.completions.create(model=MODEL_ID, messages=[
        {"role": "user", "content": "fail, please"}], user="boom", max_tokens=3, stream=True)
    with pytest.raises(openai.APIError, match="boom in a processor"):
        list(stream)
    assert [(e.state.tokens, e.nbytes) for e in live.store.entries] == entries
    assert get(live.port, "/health")[0] == 200
    reply = client.completions.create(model=MODEL_ID, prompt="ok", max_tokens=1)
    assert reply.choices[0].finish_reason == "length"


def test_a_500_keeps_the_connection_open(live):
    """A request that fails with a 500 does not close its keep-alive connection: the next
    request on it (as a client's connection pool sends it) is served."""
    live.hook.scripts["boom"] = RuntimeError("boom in a processor")
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=60)
    body = json.dumps({"messages": [{"role": "user", "content": "fail"}], "user": "boom",
                       "max_tokens": 2})
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    failed = conn.getresponse()
    assert failed.status == 500 and b"boom in a processor" in failed.read()
    conn.request("GET", "/health")
    again = conn.getresponse()
    assert again.status == 200 and json.loads(again.read())["status"] == "ok"
    conn.close()


# ----------------------------------------------------------------------------- serving

def test_cancel_stops_within_a_token(live):
    """The worker checks the flag after every token: cancelled while the 4th token is
    sampled, the reply has 3 (the 4th was not yielded) or at most 4."""
    model, tokenizer = tiny()
    prompt = tokenizer.encode_prompt("Count to ten")
    holder = {}

    def cancel_at_third(history, logits):
        if history.shape[0] - len(prompt) == 3:
            holder["job"].cancel()
        return logits

    async def run():
        with live.engine.lock:  # the worker waits until the job is known here
            holder["job"] = live.engine.submit(prompt, Settings(max_tokens=60,
                                                                processors=[cancel_at_third]))
        return [event async for event in holder["job"].events()]

    events = asyncio.run(run())
    finish = events[-1]
    assert finish.reason == "cancelled" and finish.completion_tokens in (3, 4)
    assert len(events) - 1 == finish.completion_tokens


@pytest.mark.parametrize("stream", [True, False])
def test_a_dropped_client_stops_its_generation(live, client, stream):
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=30)
    body = {"messages": [{"role": "user", "content": "Tell me a long story"}],
            "max_tokens": 400, "stream": stream, "user": "long"}
    live.hook.add("long", "a" * 400, eos=False)  # never stops by itself
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    if stream:
        response = conn.getresponse()
        lines = [response.readline() for _ in range(6)]  # role chunk, 2 token chunks, blanks
        assert all(line.startswith(b"data: ") or line == b"\n" for line in lines)
    else:
        time.sleep(1.0)  # the reply is being generated (it would take ~30 s)
        assert live.engine.in_flight == 1
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    assert live.wait_idle(10), "the generation went on after the client left"
    finish = live.engine.last_finish
    assert finish.reason == "cancelled" and finish.completion_tokens < 100
    reply = client.completions.create(model=MODEL_ID, prompt="still here?", max_tokens=1)
    assert reply.usage.completion_tokens == 1


def test_past_the_bound_requests_get_429(live):
    (status, reply), held = one_past_the_bound(live, "/v1/completions",
                                               {"prompt": "q", "max_tokens": 1})
    assert status == 429 and reply["error"]["code"] == "server_busy"
    assert held == [200] * live.engine.max_concurrent
