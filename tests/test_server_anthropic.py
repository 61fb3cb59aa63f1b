"""Anthropic's Messages API on `mlx_v41.server` (tiny golden checkpoint), driven by the real
`anthropic` client and raw HTTP: greedy replies equal `mlx_v41.generate`, thinking / text /
tool_use blocks forced on the real model, the official tool round trip rendered exactly and
served from the prompt cache, streaming event order, stop sequences, count_tokens, the
thinking budget's effort, forced tool use, and errors in Anthropic's shape."""

from __future__ import annotations

import base64
import http.client
import io
import json
import socket
from pathlib import Path

import anthropic
import jsonschema
import pytest
from PIL import Image

import mlx_v41
from mlx_v41.chat import format as cf
from mlx_v41.server.anthropic import protocol as ap
from conftest import slow
from server_harness import (MODEL_ID, forcing_server, get, one_past_the_bound, post, tiny,
                            write_swa_checkpoint)

pytestmark = pytest.mark.usefixtures("cpu")

VECTORS = json.loads((Path(__file__).parent / "data" / "chat_vectors.json").read_text("utf-8"))
ROUNDTRIP = next(c for c in VECTORS["cases"] if c["name"] == "thinking_tools_roundtrip")
CHAT = {"type": "disabled"}
HELLO = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def live():
    yield from forcing_server(*tiny())


@pytest.fixture(scope="module")
def client(live):
    return anthropic_client(live)


@pytest.fixture(scope="module")
def swa(tmp_path_factory):
    """The tool tests' server: a 2-layer sliding-window checkpoint decodes their long replies
    (1,000-token prompts, 150-token calls) several times faster."""
    yield from forcing_server(*mlx_v41.load(write_swa_checkpoint(
        tmp_path_factory.mktemp("swa") / "hf")))


@pytest.fixture(scope="module")
def swa_client(swa):
    return anthropic_client(swa)


def anthropic_client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="unused",
                               max_retries=0)


def forced(live, name: str, text: str) -> dict:
    """The request fields that make the model write `text` (then EOS)."""
    live.hook.add(name, text)
    return {"metadata": {"user_id": name}}


def rendered(live) -> str:
    """The text of the last prompt the server rendered."""
    return live.engine.tokenizer.decode(live.hook.prompts[-1])


def reference(messages, max_tokens, thinking=False):
    """(text, tokens, prompt length) of `mlx_v41.generate`'s greedy run on the same chat."""
    model, tokenizer = tiny()
    ids = tokenizer.apply_chat_template(messages, enable_thinking=thinking)
    responses = list(mlx_v41.stream_generate(model, tokenizer, ids, max_tokens=max_tokens))
    return "".join(r.text for r in responses), [r.token for r in responses], len(ids)


def raw_events(live, body: dict) -> list:
    """(event name, data) of each SSE event of a streamed request, sent raw."""
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=60)
    conn.request("POST", "/v1/messages", json.dumps(dict(body, stream=True)),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    assert response.getheader("content-type").startswith("text/event-stream")
    text = response.read().decode()
    conn.close()
    events = []
    for chunk in text.strip().split("\n\n"):
        name, data = chunk.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        events.append((name[len("event: "):], json.loads(data[len("data: "):])))
    return events


# ----------------------------------------------------------------------------- replies

def test_greedy_reply_equals_generate_with_usage(client):
    text, tokens, prompt_length = reference(HELLO, 6)
    reply = client.messages.create(model=MODEL_ID, max_tokens=6, messages=HELLO,
                                   thinking=CHAT)
    assert [block.type for block in reply.content] == ["text"]
    assert reply.content[0].text == text and reply.stop_reason == "max_tokens"
    assert reply.id.startswith("msg_") and reply.role == "assistant" and reply.model == MODEL_ID
    usage = reply.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == prompt_length
    assert usage.output_tokens == len(tokens) and usage.cache_creation_input_tokens == 0


def test_thinking_and_text_blocks(live, client):
    fields = forced(live, "think", "Let me see.</think>It is 4.")
    reply = client.messages.create(model=MODEL_ID, max_tokens=40, messages=HELLO, **fields)
    thinking, text = reply.content
    assert (thinking.type, thinking.thinking) == ("thinking", "Let me see.")
    assert isinstance(thinking.signature, str) and thinking.signature
    assert (text.type, text.text) == ("text", "It is 4.")
    assert reply.stop_reason == "end_turn" and reply.stop_sequence is None
    assert rendered(live).endswith(cf.USER + "Hello there" + cf.ASSISTANT + cf.THINK_START)


@pytest.mark.slow
def test_streamed_helpers_equal_the_whole_reply(live, client):
    fields = forced(live, "stream", "Hmm.</think>Streamed answer.")
    whole = client.messages.create(model=MODEL_ID, max_tokens=40, messages=HELLO, **fields)
    with client.messages.stream(model=MODEL_ID, max_tokens=40, messages=HELLO,
                                **fields) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Streamed answer."
    assert [b.model_dump(exclude={"parsed_output", "citations"}) for b in final.content] == \
        [b.model_dump(exclude={"citations"}) for b in whole.content]
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens


def test_stream_event_order(live):
    live.hook.add("order", "Why.</think>Text")
    events = raw_events(live, {"model": MODEL_ID, "max_tokens": 40, "messages": HELLO,
                               "metadata": {"user_id": "order"}})
    names = [name for name, _ in events]
    assert all(data["type"] == name for name, data in events)
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta",
                                                                      "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    blocks = events[2:-2]
    assert {name for name, _ in blocks} == {"content_block_start", "content_block_delta",
                                            "content_block_stop"}
    opened = [(d["index"], d["content_block"]["type"]) for n, d in blocks
              if n == "content_block_start"]
    assert opened == [(0, "thinking"), (1, "text")]
    closed = [d["index"] for n, d in blocks if n == "content_block_stop"]
    assert closed == [0, 1]
    deltas = [(d["index"], d["delta"]) for n, d in blocks if n == "content_block_delta"]
    thinking = "".join(d["thinking"] for i, d in deltas if d["type"] == "thinking_delta")
    assert thinking == "Why." and all(i == 0 for i, d in deltas if d["type"] != "text_delta")
    [signature] = [d["signature"] for i, d in deltas if d["type"] == "signature_delta"]
    assert signature
    # the signature closes the thinking block: it comes after the thinking deltas
    kinds = [d["type"] for _, d in deltas]
    assert kinds.index("signature_delta") == kinds.count("thinking_delta")
    assert "".join(d["text"] for i, d in deltas if d["type"] == "text_delta") == "Text"
    # each block's events lie between its start and its stop
    for index in (0, 1):
        at = [k for k, (n, d) in enumerate(blocks) if d.get("index") == index]
        assert blocks[at[0]][0] == "content_block_start"
        assert blocks[at[-1]][0] == "content_block_stop"
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == len(live.hook.scripts["order"])


def test_stop_sequences(live, client):
    fields = forced(live, "stops", "Hello world. Bye now.")
    reply = client.messages.create(model=MODEL_ID, max_tokens=40, messages=HELLO,
                                   thinking=CHAT, stop_sequences=["never", "Bye"], **fields)
    assert reply.content[0].text == "Hello world. "
    assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", "Bye")
    events = raw_events(live, {"model": MODEL_ID, "max_tokens": 40, "messages": HELLO,
                               "thinking": CHAT, "stop_sequences": ["Bye"],
                               "metadata": {"user_id": "stops"}})
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "Bye"}


def test_count_tokens_equals_the_rendered_prompt(client):
    _, tokenizer = tiny()
    tools = [{"name": "get_time", "description": "Now.",
              "input_schema": {"type": "object", "properties": {}}}]
    count = client.messages.count_tokens(model=MODEL_ID, system="Be brief.", tools=tools,
                                         messages=HELLO)
    ids = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}] + HELLO, tools=[{
            "type": "function", "function": {"name": "get_time", "description": "Now.",
                                             "parameters": tools[0]["input_schema"]}}])
    assert count.input_tokens == len(ids)
    count = client.messages.count_tokens(model=MODEL_ID, messages=HELLO, thinking=CHAT)
    assert count.input_tokens == len(tokenizer.apply_chat_template(HELLO,
                                                                   enable_thinking=False))


def test_image_block_equals_the_openai_image_part(live, client):
    """A base64 image source renders (and counts) as the OpenAI route's `image_url` part."""
    buffer = io.BytesIO()
    Image.new("RGB", (60, 40), (200, 30, 30)).save(buffer, format="PNG")
    data = base64.b64encode(buffer.getvalue()).decode()
    blocks = [{"type": "text", "text": "What is it?"},
              {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                           "data": data}}]
    reply = client.messages.create(model=MODEL_ID, max_tokens=1, thinking=CHAT,
                                   messages=[{"role": "user", "content": blocks}])
    ours = live.hook.prompts[-1]
    count = client.messages.count_tokens(model=MODEL_ID, thinking=CHAT,
                                         messages=[{"role": "user", "content": blocks}])
    code, openai = post(live.port, "/v1/chat/completions", {
        "max_tokens": 1, "chat_template_kwargs": {"thinking": False}, "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "What is it?"},
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}]}]})
    assert code == 200 and live.hook.prompts[-1] == ours
    assert count.input_tokens == len(ours) == openai["usage"]["prompt_tokens"]
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == len(ours)


# ----------------------------------------------------------------------------- tools

def roundtrip_request() -> tuple:
    """The official tool round trip as an Anthropic request: (system, tools, user message,
    the generated assistant text, the tool result)."""
    system, user, _, tool = ROUNDTRIP["messages"]
    function = system["tools"][0]["function"]
    tools = [{"name": function["name"], "description": function["description"],
              "input_schema": function["parameters"]}]
    prompt = ROUNDTRIP["prompt"]
    start = prompt.index(cf.ASSISTANT + cf.THINK_START) + len(cf.ASSISTANT + cf.THINK_START)
    generated = prompt[start:prompt.index(cf.EOS, start)]
    return system["content"], tools, user, generated, tool["content"]


@pytest.mark.slow
def test_tool_use_round_trip_renders_the_official_prompt_from_the_cache(swa, swa_client):
    system, tools, user, generated, result = roundtrip_request()
    fields = forced(swa, "tool", generated)
    reply = swa_client.messages.create(model=MODEL_ID, max_tokens=300, system=system,
                                       tools=tools, messages=[user], **fields)
    turn_one = swa.hook.prompts[-1]
    assert reply.stop_reason == "tool_use"
    thinking, call = reply.content
    assert thinking.thinking == "Need the tool."
    assert call.type == "tool_use" and call.id.startswith("toolu_")
    assert (call.name, call.input) == ("get_weather", {"city": "Paris", "days": 2})

    history = [user, {"role": "assistant", "content": reply.content},  # as the client's docs
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": result}]}]
    second = swa_client.messages.create(model=MODEL_ID, max_tokens=1, system=system,
                                        tools=tools, messages=history)
    assert rendered(swa) == ROUNDTRIP["prompt"]
    assert second.usage.cache_read_input_tokens == \
        len(turn_one) + len(swa.hook.scripts["tool"])
    assert second.usage.input_tokens == len(swa.hook.prompts[-1]) - \
        second.usage.cache_read_input_tokens


SMALL_TOOL = {"name": "f", "input_schema": {"type": "object", "properties": {
    "a": {"type": "string"}, "b": {"type": "integer"}}}}
SMALL_CALL = (f'\n\n{cf.CALLS_OPEN}\n{cf.INVOKE_OPEN} name="f">\n{cf.PARAM_OPEN} name="a" '
              f'string="true">x{cf.PARAM_CLOSE}\n{cf.PARAM_OPEN} name="b" string="false">7'
              f'{cf.PARAM_CLOSE}\n{cf.INVOKE_CLOSE}\n{cf.CALLS_CLOSE}')


@pytest.mark.slow
def test_streamed_tool_use_arrives_as_input_json(swa, swa_client):
    fields = forced(swa, "small", "Calling." + SMALL_CALL)
    with swa_client.messages.stream(model=MODEL_ID, max_tokens=200, tools=[SMALL_TOOL],
                                    messages=HELLO, thinking=CHAT, **fields) as stream:
        events = list(stream)
        final = stream.get_final_message()
    fragments = [e.delta.partial_json for e in events if e.type == "content_block_delta"
                 and e.delta.type == "input_json_delta"]
    assert len(fragments) >= 2 and json.loads("".join(fragments)) == {"a": "x", "b": 7}
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [(b.type, getattr(b, "name", None)) for b in starts] == [("text", None),
                                                                   ("tool_use", "f")]
    assert starts[1].input == {} and starts[1].id.startswith("toolu_")
    assert final.stop_reason == "tool_use" and final.content[0].text == "Calling."
    assert final.content[1].input == {"a": "x", "b": 7}


def test_tool_result_error_and_blocks_render_as_the_format_does(swa, swa_client):
    system, tools, user, generated, _ = roundtrip_request()
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "X"}}
    swa_client.messages.create(model=MODEL_ID, max_tokens=1, system=system, tools=tools,
                               thinking=CHAT, messages=[
                                   user, {"role": "assistant", "content": [use]},
                                   {"role": "user", "content": [
                                       {"type": "tool_result", "tool_use_id": "toolu_1",
                                        "is_error": True, "content": [
                                            {"type": "text", "text": "no such city"}]},
                                       {"type": "text", "text": "Try again."}]}])
    assert rendered(swa).endswith(
        cf.USER + "<tool_result>Error:\n\nno such city</tool_result>\n\nTry again."
        + cf.ASSISTANT + cf.THINK_END)


def test_tool_choice_none_masks_the_dsml_token(swa, swa_client):
    system, tools, user, generated, _ = roundtrip_request()
    fields = forced(swa, "tool", generated)
    reply = swa_client.messages.create(model=MODEL_ID, max_tokens=40, system=system,
                                       tools=tools, messages=[user],
                                       tool_choice={"type": "none"}, **fields)
    assert all(block.type != "tool_use" for block in reply.content)
    assert reply.stop_reason != "tool_use"


def test_tool_choice_terms():
    def use(choice):
        body = ap.MessagesRequest.model_validate({"max_tokens": 5, "messages": HELLO,
                                                  "tool_choice": choice})
        return ap.tool_use(body)
    assert use({"type": "any", "disable_parallel_tool_use": True}) == \
        ap.ToolUse(calls="required", parallel=False)
    assert use({"type": "tool", "name": "f"}) == ap.ToolUse(named="f")
    assert use({"type": "none"}) == ap.ToolUse(calls="none", allow_calls=False)
    assert use({"type": "auto"}) == ap.ToolUse()


WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "days": {"type": "integer", "minimum": 1, "maximum": 9},
    "units": {"enum": ["c", "f"]}}, "required": ["city", "days", "units"],
    "additionalProperties": False}


ANY = {"type": "any", "disable_parallel_tool_use": True}
NAMED = {"type": "tool", "name": "weather", "disable_parallel_tool_use": True}


@pytest.mark.parametrize("choice, seed", [(ANY, 0), slow(ANY, 1), slow(ANY, 2), (NAMED, 0),
                                          slow(NAMED, 1), slow(NAMED, 2)])
@pytest.mark.slow
def test_forced_tool_use_validates_against_the_schema(swa_client, choice, seed):
    """Sampled (temperature 1) from the random model: the grammar alone makes the call."""
    tools = [{"name": "weather", "input_schema": WEATHER},
             {"name": "other", "input_schema": {"type": "object", "properties": {
                 "x": {"type": "boolean"}}, "required": ["x"]}}]
    reply = swa_client.messages.create(model=MODEL_ID, max_tokens=400, tools=tools,
                                       tool_choice=choice, messages=HELLO, thinking=CHAT,
                                       extra_body={"seed": seed, "temperature": 1.0})
    assert reply.stop_reason == "tool_use", reply
    [call] = [b for b in reply.content if b.type == "tool_use"]
    assert call.name in (["weather"] if choice is NAMED else ["weather", "other"])
    jsonschema.validate(call.input, next(t["input_schema"] for t in tools
                                         if t["name"] == call.name))


ANSWER = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0},
                                            "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}


def test_output_format_constrains_the_answer(swa_client):
    reply = swa_client.messages.create(
        model=MODEL_ID, max_tokens=200, messages=HELLO, thinking=CHAT,
        extra_body={"seed": 0, "temperature": 1.0, "output_config": {
            "format": {"type": "json_schema", "schema": ANSWER}}})
    assert reply.stop_reason == "end_turn", reply
    [text] = reply.content
    jsonschema.validate(json.loads(text.text), ANSWER)


# ----------------------------------------------------------------------------- thinking

@pytest.mark.parametrize("budget, effort", [(1024, 50), (4095, 50), (4096, 75), (10000, 75),
                                            (16384, 100), (31999, 100)])
def test_budget_sets_the_effort_line(live, budget, effort):
    """Sent raw: the client refuses a non-streamed request of 32,000 max_tokens."""
    code, _ = post(live.port, "/v1/messages", {
        "model": MODEL_ID, "max_tokens": budget + 1, "messages": HELLO,
        "thinking": {"type": "enabled", "budget_tokens": budget},
        **forced(live, "short", "a</think>b")})
    assert code == 200
    assert rendered(live).startswith(cf.BOS + cf.SYSTEM + cf.EFFORT_LINE.format(effort))


def test_the_format_is_rendered_into_the_system_message(live, client):
    """As the official encoding renders a response format: the model is told the schema."""
    text_format = {"type": "json_schema", "schema": {"type": "object"}}
    client.messages.create(model=MODEL_ID, max_tokens=1, messages=HELLO, system="Be brief.",
                           thinking=CHAT, extra_body={"output_config": {"format": text_format}})
    prompt = live.engine.tokenizer.decode(live.hook.prompts[-1])
    assert prompt.startswith(cf.BOS + cf.SYSTEM + "Be brief." + cf.RESPONSE_FORMAT_HEAD +
                             json.dumps(text_format) + cf.USER + "Hello there")


def test_output_config_effort_and_chat_mode(live, client):
    client.messages.create(model=MODEL_ID, max_tokens=4, messages=HELLO,
                           extra_body={"output_config": {"effort": "medium"}})
    assert rendered(live).startswith(cf.BOS + cf.SYSTEM + cf.EFFORT_LINE.format(75))
    client.messages.create(model=MODEL_ID, max_tokens=4, messages=HELLO, thinking=CHAT)
    assert rendered(live).endswith(cf.ASSISTANT + cf.THINK_END)
    assert "Reasoning Effort" not in rendered(live)


def test_budget_caps_the_reasoning(live, client):
    fields = forced(live, "ramble", "a b c d e f g h i j k l m n o p</think>done")
    reply = client.messages.create(model=MODEL_ID, max_tokens=40, messages=HELLO,
                                   thinking={"type": "enabled", "budget_tokens": 4}, **fields)
    _, tokenizer = tiny()
    thinking = [b for b in reply.content if b.type == "thinking"]
    assert thinking and len(tokenizer.encode(thinking[0].thinking,
                                             add_special_tokens=False)) <= 4


def test_assistant_prefill_is_continued(live, client):
    fields = forced(live, "prefill", " Paris.")
    reply = client.messages.create(model=MODEL_ID, max_tokens=10, **fields, messages=HELLO + [
        {"role": "assistant", "content": "The answer is"}])
    assert rendered(live).endswith(cf.ASSISTANT + cf.THINK_START + cf.THINK_END
                                   + "The answer is")
    assert [(b.type, b.text) for b in reply.content] == [("text", " Paris.")]


# ----------------------------------------------------------------------------- errors

USE = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}
TOOL = {"name": "f", "input_schema": {"type": "object"}}
BAD_BODIES = [
    (b'{"messages": [', 400, "not valid JSON"),
    ({"messages": HELLO}, 400, "max_tokens: Field required"),
    ({"max_tokens": "5", "messages": HELLO}, 400, "max_tokens: Input should be a valid int"),
    ({"max_tokens": 0, "messages": HELLO}, 400, "max_tokens: Input should be greater"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, 400,
     "messages.0.role: Input should be 'user' or 'assistant'"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": 5}]}, 400,
     "messages.0.content: Input should be a valid string or a valid list"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400,
     "messages.0.content.0.text: Field required"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "video"}]}]}, 400,
     "messages.0.content.0: Input tag 'video'"),
    ({"max_tokens": 5, "temperature": 1.5, "messages": HELLO}, 400, "temperature"),
    ({"max_tokens": 5, "stream": 1, "messages": HELLO}, 400, "stream: Input should be a valid"),
    ({"max_tokens": 5, "messages": HELLO + [
        {"role": "assistant", "content": [USE]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2"}]}]},
     400, "messages.2.content.0.tool_use_id: no tool_use block with id 'toolu_2'"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text",
                                                                        "text": 3}]}]}]},
     400, "messages.0.content.0.content.0.text: Input should be a valid string"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [USE]}]}, 400,
     "messages.0.content.0: a tool_use block is not allowed in a user message"),
    ({"max_tokens": 5, "messages": HELLO, "tools": [TOOL], "tool_choice": {
        "type": "tool", "name": "g"}}, 400, "tool_choice: the tool 'g' is not among"),
    ({"max_tokens": 5, "messages": HELLO, "tool_choice": {"type": "tool"}}, 400,
     "tool_choice.name: Field required"),
    ({"max_tokens": 5, "messages": HELLO, "tools": [{"name": "f"}]}, 400,
     "tools.0.input_schema: Field required"),
    ({"max_tokens": 5, "messages": HELLO, "tools": [{"type": "web_search_20250305",
                                                     "name": "web_search"}]}, 400,
     "tools.0.type: the server tool 'web_search_20250305' is not supported"),
    ({"max_tokens": 5, "messages": HELLO, "thinking": {"type": "enabled"}}, 400,
     "thinking.budget_tokens: Field required"),
    ({"max_tokens": 5, "messages": HELLO, "thinking": {"type": "enabled",
                                                       "budget_tokens": 5}}, 400,
     "thinking.budget_tokens: must be less than max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}]}]}, 400,
     "messages.0.content.0.source: image URLs are not fetched"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AAAA"}}]}]}, 400,
     "messages.0.content.0: not an image this server reads"),
    ({"max_tokens": 5, "messages": HELLO, "tool_choice": {"type": "any"}, "tools": [
        {"name": "f", "input_schema": {"type": "object", "properties": {
            "a": {"type": "strange"}}}}]}, 400, "tools: the grammar library cannot compile"),
    ({"max_tokens": 5, "messages": HELLO, "tool_choice": {"type": "any"}}, 400,
     "tool_choice: forcing a tool call needs tools"),
    ({"max_tokens": 5, "messages": HELLO, "output_config": {"format": {"type": "text"}}}, 400,
     "output_config.format: expected"),
    ({"max_tokens": 5, "model": "claude-9", "messages": HELLO}, 404,
     "the model 'claude-9' does not exist"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi \ud800"}]}, 400,
     "messages.0.content: lone surrogate U+D800"),
]
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error"}


@pytest.mark.parametrize("body, status, words", BAD_BODIES)
def test_bad_input_is_an_anthropic_error(live, body, status, words):
    code, reply = post(live.port, "/v1/messages", body)
    assert code == status
    assert set(reply) == {"type", "error"} and reply["type"] == "error"
    assert reply["error"]["type"] == ERROR_TYPES[status]
    assert words in reply["error"]["message"] and "\n" not in reply["error"]["message"]


def test_errors_through_the_client_and_other_paths_keep_openai_shape(live, client):
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL_ID, max_tokens=5, messages=HELLO,
                               tools=[TOOL], tool_choice={"type": "tool", "name": "g"})
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="claude-9", messages=HELLO)
    code, reply = post(live.port, "/v1/messages/count_tokens", {"messages": "hi"})
    assert code == 400 and reply["error"]["message"].startswith("messages: Input should be")
    code, reply = post(live.port, "/v1/messages/batches", {})
    assert code == 404 and reply["error"]["type"] == "not_found_error"
    code, reply = post(live.port, "/v1/chat/completions", {"messages": "hi"})
    assert code == 400 and set(reply["error"]) == {"message", "type", "param", "code"}
    assert get(live.port, "/health") == (200, {"status": "ok", "model": MODEL_ID})


@pytest.mark.slow
def test_a_failing_request_leaves_the_server_healthy(live, client):
    live.hook.scripts["boom"] = RuntimeError("boom in a processor")
    entries = [(e.state.tokens, e.nbytes) for e in live.store.entries]
    body = {"model": MODEL_ID, "max_tokens": 3, "messages": [
        {"role": "user", "content": "fail, please"}], "metadata": {"user_id": "boom"}}
    code, reply = post(live.port, "/v1/messages", body)
    assert code == 500 and reply["error"]["type"] == "api_error"
    assert "boom in a processor" in reply["error"]["message"]
    events = raw_events(live, body)
    assert [name for name, _ in events][:2] == ["message_start", "ping"]
    name, data = events[-1]
    assert name == "error" and data["error"]["type"] == "api_error"
    with pytest.raises(anthropic.APIStatusError, match="boom in a processor"):
        with client.messages.stream(**body) as stream:
            stream.get_final_message()
    assert [(e.state.tokens, e.nbytes) for e in live.store.entries] == entries
    reply = client.messages.create(model=MODEL_ID, max_tokens=1, messages=HELLO)
    assert reply.usage.output_tokens == 1


def test_a_dropped_stream_stops_its_generation(live):
    live.hook.add("long", "a" * 400, eos=False)  # never stops by itself
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=30)
    conn.request("POST", "/v1/messages", json.dumps({
        "model": MODEL_ID, "max_tokens": 400, "messages": HELLO, "thinking": CHAT,
        "stream": True, "metadata": {"user_id": "long"}}), {"Content-Type": "application/json"})
    response = conn.getresponse()
    lines = [response.readline() for _ in range(12)]  # start, ping, a block, 2 deltas
    assert lines[0] == b"event: message_start\n" and b"event: content_block_delta\n" in lines
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    assert live.wait_idle(10), "the generation went on after the client left"
    finish = live.engine.last_finish
    assert finish.reason == "cancelled" and finish.completion_tokens < 100


def test_past_the_bound_requests_get_a_rate_limit_error(live):
    body = {"model": MODEL_ID, "max_tokens": 1, "messages": HELLO}
    (status, reply), held = one_past_the_bound(live, "/v1/messages", body)
    assert status == 429 and reply["error"]["type"] == "rate_limit_error"
    assert held == [200] * live.engine.max_concurrent


def test_a_second_turn_reads_the_first_from_the_cache(live, client):
    """Chat mode: turn 1's prompt and reply are the start of turn 2's prompt."""
    fields = forced(live, "turns", "Sure, here it is.")
    first = client.messages.create(model=MODEL_ID, max_tokens=40, thinking=CHAT,
                                   messages=[{"role": "user", "content": "Turn one"}], **fields)
    turn_one = len(live.hook.prompts[-1])
    second = client.messages.create(model=MODEL_ID, max_tokens=1, thinking=CHAT, messages=[
        {"role": "user", "content": "Turn one"},
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": "Turn two"}])
    assert second.usage.cache_read_input_tokens == turn_one + len(live.hook.scripts["turns"])
