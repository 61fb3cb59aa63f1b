"""`mlx_v41.server` on a 2-layer sliding-window checkpoint (the cheapest decode: these tests are
about serving, not the model): DSML tool calls forced on the real model through the `openai`
client, streamed and not, the follow-up turn rendered as the official vector; `tool_choice`
"none"; 8 concurrent clients x 25 requests with flat memory."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_v41
from mlx_v41.chat import format as cf
from server_harness import MODEL_ID, forcing_server, write_swa_checkpoint

pytestmark = pytest.mark.usefixtures("cpu")

VECTORS = json.loads((Path(__file__).parent / "data" / "chat_vectors.json").read_text("utf-8"))
ROUNDTRIP = next(c for c in VECTORS["cases"] if c["name"] == "thinking_tools_roundtrip")
CHAT_OFF = {"chat_template_kwargs": {"thinking": False}}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return mlx_v41.load(write_swa_checkpoint(tmp_path_factory.mktemp("swa") / "hf"))


@pytest.fixture(scope="module")
def live(loaded):
    yield from forcing_server(*loaded)


@pytest.fixture(scope="module")
def client(live):
    return live.client()


def roundtrip_parts():
    """The vector's request (system with tools, user), its generated assistant text and the
    rendered follow-up prompt."""
    system, user, assistant, tool = ROUNDTRIP["messages"]
    prompt = ROUNDTRIP["prompt"]
    start = prompt.index(cf.ASSISTANT + cf.THINK_START) + len(cf.ASSISTANT + cf.THINK_START)
    generated = prompt[start:prompt.index(cf.EOS, start)]
    request = [{"role": "system", "content": system["content"]}, user]
    return request, system["tools"], generated, tool


def check_call(call, arguments_text):
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(arguments_text) == {"city": "Paris", "days": 2}


@pytest.mark.slow
def test_tool_call_streamed_and_not_then_follow_up(live, client):
    request, tools, generated, tool = roundtrip_parts()
    live.hook.add("tool", generated)
    reply = client.chat.completions.create(model=MODEL_ID, messages=request, tools=tools,
                                           max_tokens=300, user="tool")
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls"
    assert message.reasoning_content == "Need the tool." and not message.content
    [call] = message.tool_calls
    check_call(call, call.function.arguments)

    chunks = list(client.chat.completions.create(model=MODEL_ID, messages=request, tools=tools,
                                                 max_tokens=300, user="tool", stream=True))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    first, fragments = deltas[0], [d.function.arguments for d in deltas[1:]]
    assert (first.index, first.type, first.function.name, first.function.arguments) == \
        (0, "function", "get_weather", "")
    assert first.id.startswith("call_") and all(d.id is None for d in deltas[1:])
    assert len(fragments) >= 2 and "".join(fragments) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    follow_up = request + [
        {"role": "assistant", "content": message.content,
         "reasoning_content": message.reasoning_content,
         "tool_calls": [c.model_dump() for c in message.tool_calls]},
        {"role": "tool", "tool_call_id": call.id, "content": tool["content"]}]
    tokenizer = live.engine.tokenizer
    second = client.chat.completions.create(model=MODEL_ID, messages=follow_up, tools=tools,
                                            max_tokens=1)
    rendered = live.hook.prompts[-1]
    assert tokenizer.decode(rendered) == ROUNDTRIP["prompt"]
    assert rendered == tokenizer.encode(ROUNDTRIP["prompt"], add_special_tokens=False)
    # The turn before (prompt + forced reply) came from the cache.
    turn_one = live.hook.prompts[-2]
    assert second.usage.prompt_tokens_details.cached_tokens == \
        len(turn_one) + len(live.hook.scripts["tool"])


def test_tool_choice_none_masks_the_dsml_token(live, client):
    request, tools, generated, _ = roundtrip_parts()
    live.hook.add("tool", generated)
    reply = client.chat.completions.create(model=MODEL_ID, messages=request, tools=tools,
                                           tool_choice="none", max_tokens=40, user="tool")
    message = reply.choices[0].message
    assert not message.tool_calls and cf.DSML not in (message.content or "")
    assert reply.choices[0].finish_reason != "tool_calls"


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.slow
def test_load_8_clients_25_requests(live, loaded):
    """Every reply complete and right for its own prompt; MLX memory flat after the first
    round (the prompt caches replace each other: same prompts)."""
    model, tokenizer = loaded
    prompts = [f"Client {k} says {'hi ' * k}" for k in range(8)]
    expected = []
    for p in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                            enable_thinking=False)
        [response] = mlx_v41.stream_generate(model, tokenizer, ids, max_tokens=1)
        expected.append((response.text, len(ids)))
    memory, errors = {}, []

    def client_loop(k, barrier):
        client = live.client()
        try:
            for i in range(25):
                reply = client.chat.completions.create(
                    model=MODEL_ID, messages=[{"role": "user", "content": prompts[k]}],
                    max_tokens=1, extra_body=CHAT_OFF)
                text, prompt_length = expected[k]
                if (reply.choices[0].message.content, reply.usage.prompt_tokens,
                        reply.usage.completion_tokens) != (text, prompt_length, 1):
                    errors.append((k, i, reply))
                if i in (4, 24):  # all clients wait here: the server is idle
                    barrier.wait()
                    if k == 0:
                        memory[i] = (mx.get_active_memory(), live.store.nbytes, rss_bytes(),
                                     len(live.store.entries))
                    barrier.wait()
        except Exception as e:  # noqa: BLE001 - reported below, and the others released
            errors.append((k, e))
            barrier.abort()

    barrier = threading.Barrier(8, timeout=120)
    threads = [threading.Thread(target=client_loop, args=(k, barrier)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert live.wait_idle() and live.store.nbytes <= live.store.max_bytes
    (active_4, store_4, rss_4, n_4), (active_24, store_24, rss_24, n_24) = memory[4], memory[24]
    # Measured: +1 KB of MLX memory, +0.2 MB RSS. One cache kept per request would add
    # 160 x 6 KB of MLX memory here.
    assert (store_24, n_24) == (store_4, n_4)
    assert active_24 - active_4 < 100_000, (active_4, active_24)
    assert rss_24 - rss_4 < 8_000_000, (rss_4, rss_24)
