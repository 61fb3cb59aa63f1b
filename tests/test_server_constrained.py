"""Constrained decoding on a live server with the real `openai` and `anthropic` clients:
`response_format` json_object / json_schema (and the client's `parse` helper), `tool_choice`
"required" and a named function, streamed and not, several choices (`n`), thinking mode,
the batching engine and --dspark; every output parses and validates (`jsonschema`) on a random
checkpoint, since the grammar, not the weights, guarantees it. Forced calls and schema answers
end where their structure ends in all three APIs and on every engine; a call cut off by
max_tokens is reported as truncated; logprobs stay finite; special tokens never reach a
reply; nested pydantic models (`$defs`) work. Bad schemas and tool names get OpenAI errors
naming the field, and the server stays healthy."""

from __future__ import annotations

import http.client
import json
import math
from pathlib import Path

import anthropic
import jsonschema
import openai
import pydantic
import pytest

import mlx_v41
from conftest import golden_checkpoint
from mlx_v41.chat import format as cf
from mlx_v41.server.conversation import with_response_format
from mlx_v41.server.reply_parser import Reply, ReplyParser, parse_reply
from nested_models import Place
from server_harness import LiveServer, forcing_server, get, post, write_swa_checkpoint

pytestmark = pytest.mark.usefixtures("cpu")

CHAT = {"chat_template_kwargs": {"thinking": False}}
USER = [{"role": "user", "content": "Give me a record."}]
RECORD = {"type": "object", "additionalProperties": False, "required": ["id", "label", "ok"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                         "label": {"type": "string", "maxLength": 6},
                         "ok": {"type": "boolean"},
                         "kind": {"enum": ["a", "b\"q", "c\\d"]}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "required": ["zone"], "properties": {
        "zone": {"enum": ["UTC", "CET"]}}}}}
TOOLS = [WEATHER, CLOCK]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return mlx_v41.load(write_swa_checkpoint(tmp_path_factory.mktemp("swa") / "hf"))


@pytest.fixture(scope="module")
def live(loaded):
    server = LiveServer(*loaded, temp=1.0)
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(live):
    return live.client()


def json_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "record", "schema": schema,
                                                   "strict": True}}


def valid_calls(message, names) -> list:
    """The message's tool calls, each checked against its tool's schema."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    return message.tool_calls


def test_json_schema_answers_validate_over_seeds(client):
    for seed in range(6):
        reply = client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=200, seed=seed,
            response_format=json_format(RECORD), extra_body=CHAT)
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), RECORD)


def test_json_object_and_the_parse_helper(client):
    reply = client.chat.completions.create(model="tiny", messages=USER, max_tokens=200,
                                           seed=3, response_format={"type": "json_object"},
                                           extra_body=CHAT)
    assert isinstance(json.loads(reply.choices[0].message.content), dict)

    class Pick(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        colour: str = pydantic.Field(max_length=5)
        count: int = pydantic.Field(ge=0, le=9)

    parsed = client.chat.completions.parse(model="tiny", messages=USER, max_tokens=200,
                                           seed=1, response_format=Pick, extra_body=CHAT)
    pick = parsed.choices[0].message.parsed
    assert isinstance(pick, Pick) and 0 <= pick.count <= 9


def test_streamed_json_and_several_choices(client):
    stream = client.chat.completions.create(model="tiny", messages=USER, max_tokens=200,
                                            seed=5, stream=True, extra_body=CHAT,
                                            response_format=json_format(RECORD))
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), RECORD)
    reply = client.chat.completions.create(model="tiny", messages=USER, max_tokens=200,
                                           seed=7, n=3, response_format=json_format(RECORD),
                                           extra_body=CHAT)
    assert len(reply.choices) == 3
    for choice in reply.choices:  # each choice has its own matcher
        jsonschema.validate(json.loads(choice.message.content), RECORD)


@pytest.mark.slow
def test_required_and_named_tool_choice(client):
    for seed in range(3):
        reply = client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=400, seed=seed, tools=TOOLS,
            tool_choice="required", extra_body=CHAT)
        assert reply.choices[0].finish_reason == "tool_calls"
        valid_calls(reply.choices[0].message, {"get_weather", "get_time"})
    named = {"type": "function", "function": {"name": "get_time"}}
    reply = client.chat.completions.create(model="tiny", messages=USER, max_tokens=400,
                                           seed=4, tools=TOOLS, tool_choice=named,
                                           parallel_tool_calls=False, extra_body=CHAT)
    calls = valid_calls(reply.choices[0].message, {"get_time"})
    assert len(calls) == 1


@pytest.mark.slow
def test_thinking_mode_constrains_after_the_reasoning(client):
    """Reasoning stays free (EOS banned until it closes); the answer after `</think>`
    validates."""
    for seed in (4, 5):  # seeds whose free reasoning closes within max_tokens
        reply = client.chat.completions.create(model="tiny", messages=USER, max_tokens=500,
                                               seed=seed, response_format=json_format(RECORD),
                                               extra_body={"reasoning_effort": "high"})
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "stop" and message.reasoning_content
        jsonschema.validate(json.loads(message.content), RECORD)


def test_bad_constraints_are_openai_errors_and_the_server_stays_healthy(live, client):
    """Each refused before any work: the prompt caches are as they were."""
    cases = [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", "nope"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"response_format": json_format({"type": "frob"})}, "response_format", "frob"),
        ({"response_format": json_format({"$ref": "#/missing"})}, "response_format",
         "missing"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "yaml"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema", "JSON schema"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "array"}}}], "tool_choice": "required"}, "tools[0].function.parameters",
         "object"),
    ]
    entries = [(e.state.tokens, e.nbytes) for e in live.store.entries]
    for extra, param, words in cases:
        status, body = post(live.port, "/v1/chat/completions",
                            {"messages": USER, "max_tokens": 5, **extra})
        assert status == 400, (extra, body)
        assert body["error"]["param"] == param and words in body["error"]["message"], body
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=5,
                                       response_format=json_format({"type": "frob"}))
    assert [(e.state.tokens, e.nbytes) for e in live.store.entries] == entries
    assert get(live.port, "/health") == (200, {"status": "ok", "model": "tiny"})
    reply = client.chat.completions.create(model="tiny", messages=USER, max_tokens=200,
                                           seed=0, response_format=json_format(RECORD),
                                           extra_body=CHAT)
    jsonschema.validate(json.loads(reply.choices[0].message.content), RECORD)


def test_a_cached_prompt_is_reused_under_a_constraint(client):
    first = client.chat.completions.create(model="tiny", messages=USER, max_tokens=200,
                                           seed=11, response_format=json_format(RECORD),
                                           extra_body=CHAT)
    again = client.chat.completions.create(model="tiny", messages=USER, max_tokens=200,
                                           seed=11, response_format=json_format(RECORD),
                                           extra_body=CHAT)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].message.content == first.choices[0].message.content


@pytest.mark.slow
def test_dspark_server_keeps_the_constraint_and_equals_plain_greedy():
    """--dspark: greedy constrained replies equal the plain engine's, and each validates."""
    model, tokenizer = mlx_v41.load(golden_checkpoint("tiny"), dspark=True)
    outputs = {}
    for name, options in (("plain", {"serial": True}),
                          ("dspark", {"batching": {"draft": "dspark", "num_draft_tokens": 3}})):
        server = LiveServer(model, tokenizer, **options)
        try:
            client = server.client()
            outputs[name] = [client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"record {i}"}],
                max_tokens=300, response_format=json_format(RECORD),
                extra_body=CHAT).choices[0].message.content for i in range(2)]
            outputs[name].append(client.chat.completions.create(
                model="tiny", messages=USER, max_tokens=400, tools=TOOLS,
                tool_choice="required", extra_body=CHAT).choices[0].message.tool_calls)
        finally:
            server.close()
    assert outputs["dspark"][:2] == outputs["plain"][:2]
    for text in outputs["plain"][:2]:
        jsonschema.validate(json.loads(text), RECORD)
    assert outputs["plain"][2] and \
        [c.function for c in outputs["dspark"][2]] == [c.function for c in outputs["plain"][2]]


def test_the_response_format_is_rendered_as_the_official_encoding(loaded):
    """The schema goes on the system message, where the chat format renders it (the official
    vector), so the model is told what the grammar enforces."""
    vectors = json.loads((Path(__file__).parent / "data" / "chat_vectors.json").read_text())
    case = next(c for c in vectors["cases"] if c["name"] == "chat_response_format")
    system, user = case["messages"]
    messages = with_response_format([{"role": "system", "content": system["content"]}, user],
                                    system["response_format"])
    assert cf.encode_messages(messages, thinking_mode="chat") == case["prompt"]
    bare = with_response_format([user], {"type": "json_object"})
    assert bare[0] == {"role": "system", "content": "", "response_format": {
        "type": "json_object"}} and bare[1] == user
    assert with_response_format([user], {"type": "text"}) == [user]


# ---------------------------------------------------------------- where a reply ends

PICK = {"type": "object", "required": ["colour"], "additionalProperties": False,
        "properties": {"colour": {"enum": ["red", "green", "blue"]},
                       "count": {"type": "integer", "minimum": 0, "maximum": 9}}}
FLAG = {"type": "object", "required": ["ok"], "additionalProperties": False,
        "properties": {"ok": {"type": "boolean"}}}
ASK = [{"role": "user", "content": "Pick a colour."}]
LIMIT = 800  # max_tokens; a forced call of the character-level vocabulary takes 100-300


def anthropic_client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="unused",
                               max_retries=0)


def ended(used: int) -> None:
    """The reply stopped where its structure ended, far from the token limit."""
    assert 0 < used < LIMIT // 2, used


def check_anthropic_calls(message, count=None) -> None:
    assert message.stop_reason == "tool_use", message
    assert message.content and all(b.type == "tool_use" for b in message.content), message
    for block in message.content:  # no text after the calls
        jsonschema.validate(block.input, PICK)
    assert count is None or len(message.content) == count
    ended(message.usage.output_tokens)


def check_openai_calls(finish: str, content, calls: list, used: int, count=None) -> None:
    assert finish == "tool_calls" and not content and calls, (finish, content, calls)
    for name, arguments in calls:
        assert name == "pick"
        jsonschema.validate(json.loads(arguments), PICK)
    assert count is None or len(calls) == count
    ended(used)


def streamed_chat(client, **kwargs) -> tuple:
    """(finish_reason, content, [(name, arguments)], completion tokens) of a streamed chat
    completion, assembled as a client does."""
    finish, content, calls, used = None, "", {}, None
    for chunk in client.chat.completions.create(stream=True, stream_options={
            "include_usage": True}, **kwargs):
        if chunk.usage is not None:
            used = chunk.usage.completion_tokens
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or ():
                name, arguments = calls.get(call.index, ("", ""))
                calls[call.index] = (name + (call.function.name or ""),
                                     arguments + (call.function.arguments or ""))
    return finish, content, [calls[i] for i in sorted(calls)], used


def check_response_calls(response, count=None) -> None:
    assert response.status == "completed", response
    assert response.output and all(o.type == "function_call" for o in response.output)
    for item in response.output:
        assert item.name == "pick" and item.status == "completed"
        jsonschema.validate(json.loads(item.arguments), PICK)
    assert count is None or len(response.output) == count
    ended(response.usage.output_tokens)


def check_replies_end(server) -> None:
    """Forced calls (parallel or not, named or any) and schema answers in the three APIs,
    streamed and not: each reply stops where its call block or JSON value ends (tool_use /
    tool_calls / completed), far under max_tokens, with no text after the calls."""
    client, claude = server.client(), anthropic_client(server)
    tool = {"name": "pick", "description": "Pick a colour", "input_schema": PICK}
    check_anthropic_calls(claude.messages.create(
        model="tiny", max_tokens=LIMIT, messages=ASK, tools=[tool],
        tool_choice={"type": "any"}))
    with claude.messages.stream(model="tiny", max_tokens=LIMIT, messages=ASK, tools=[tool],
                                tool_choice={"type": "tool", "name": "pick",
                                             "disable_parallel_tool_use": True}) as stream:
        check_anthropic_calls(stream.get_final_message(), count=1)

    function = {"type": "function", "function": {"name": "pick", "parameters": PICK}}
    chat = {"model": "tiny", "messages": ASK, "max_tokens": LIMIT, "temperature": 0,
            "tools": [function]}
    check_openai_calls(*streamed_chat(client, tool_choice="required", **chat))
    reply = client.chat.completions.create(
        tool_choice={"type": "function", "function": {"name": "pick"}},
        parallel_tool_calls=False, **chat)
    message = reply.choices[0].message
    check_openai_calls(reply.choices[0].finish_reason, message.content,
                       [(c.function.name, c.function.arguments) for c in message.tool_calls],
                       reply.usage.completion_tokens, count=1)
    for stream in (False, True):
        request = dict(chat, tools=None, response_format=json_format(FLAG))
        if stream:
            finish, content, calls, used = streamed_chat(client, **request)
        else:
            reply = client.chat.completions.create(**request)
            finish, content = reply.choices[0].finish_reason, reply.choices[0].message.content
            calls, used = reply.choices[0].message.tool_calls, reply.usage.completion_tokens
        assert finish == "stop" and not calls
        jsonschema.validate(json.loads(content), FLAG)
        ended(used)

    spec = {"type": "function", "name": "pick", "parameters": PICK}
    turn = {"model": "tiny", "input": "Pick a colour.", "max_output_tokens": LIMIT,
            "temperature": 0, "tools": [spec], "tool_choice": "required"}
    check_response_calls(client.responses.create(**turn))
    events = list(client.responses.create(stream=True, parallel_tool_calls=False, **turn))
    assert events[-1].type == "response.completed"
    check_response_calls(events[-1].response, count=1)
    answer = client.responses.create(model="tiny", input="A flag.", temperature=0,
                                     max_output_tokens=LIMIT, text={"format": {
                                         "type": "json_schema", "name": "flag",
                                         "schema": FLAG}})
    assert answer.status == "completed" and [o.type for o in answer.output] == ["message"]
    jsonschema.validate(json.loads(answer.output_text), FLAG)
    ended(answer.usage.output_tokens)


@pytest.fixture(scope="module")
def chat_mode(loaded):
    """The batching server as `mlx_v41.server --no-thinking` runs it."""
    server = LiveServer(*loaded, thinking=False)
    yield server
    server.close()


@pytest.mark.slow
def test_forced_calls_and_answers_end_in_every_api(chat_mode):
    check_replies_end(chat_mode)


@pytest.mark.slow
@pytest.mark.parametrize("options", [{"serial": True},
                                     {"batching": {"draft": "dspark", "num_draft_tokens": 3}},
                                     {"draft": "dspark"}],
                         ids=["serial", "batch-dspark", "serial-dspark"])
def test_forced_calls_and_answers_end_on_every_engine(loaded, options):
    """The serial engine, and both engines drafting with DSpark (the checkpoint's drafter):
    the same ends."""
    server = LiveServer(*loaded, thinking=False, **options)
    try:
        check_replies_end(server)
    finally:
        server.close()


# ---------------------------------------------------------------- a reply cut off in its calls

NOTE = {"type": "object", "required": ["note"], "properties": {"note": {"type": "string"}}}
CUT = 60  # max_tokens: inside the first call's free string parameter


def no_markup(text) -> None:
    assert not text or (cf.DSML not in text and "<" not in text), text


@pytest.mark.slow
def test_a_call_cut_off_by_max_tokens_is_reported_as_truncated(chat_mode):
    """A forced call whose string parameter runs past max_tokens: no call, no DSML in the
    text, and the finish says so: length, max_tokens, incomplete (streamed too)."""
    client, claude = chat_mode.client(), anthropic_client(chat_mode)
    function = {"type": "function", "function": {"name": "note", "parameters": NOTE}}
    chat = {"model": "tiny", "messages": ASK, "max_tokens": CUT, "tools": [function],
            "tool_choice": "required"}
    reply = client.chat.completions.create(**chat)
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls, choice
    no_markup(choice.message.content)
    assert reply.usage.completion_tokens == CUT
    finish, content, _, used = streamed_chat(client, **chat)
    assert finish == "length" and used == CUT
    no_markup(content)

    tool = {"name": "note", "input_schema": NOTE}
    request = {"model": "tiny", "max_tokens": CUT, "messages": ASK, "tools": [tool],
               "tool_choice": {"type": "any"}}
    message = claude.messages.create(**request)
    assert message.stop_reason == "max_tokens" and message.content == [], message
    with claude.messages.stream(**request) as stream:
        events = list(stream)
    assert events[-1].type == "message_stop"
    assert stream.get_final_message().stop_reason == "max_tokens"
    for event in events:
        if event.type == "content_block_delta" and event.delta.type == "text_delta":
            no_markup(event.delta.text)

    turn = {"model": "tiny", "input": "Pick a colour.", "max_output_tokens": CUT,
            "tools": [{"type": "function", "name": "note", "parameters": NOTE}],
            "tool_choice": "required"}
    response = client.responses.create(**turn)
    assert response.status == "incomplete" and response.incomplete_details.reason == \
        "max_output_tokens"
    assert all(o.type == "message" for o in response.output), response.output
    no_markup(response.output_text)
    events = list(client.responses.create(stream=True, **turn))
    assert events[-1].type == "response.incomplete"
    assert all(o.type == "message" for o in events[-1].response.output)
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert all(item.status == "incomplete" for item in done if item.type == "function_call")


def test_the_parser_drops_a_cut_call_block():
    """`finish(cut=True)`: complete calls stand, the call that did not close and the block's
    markup go, text before the block stays; fed whole or a character at a time. Without
    `cut` (a block that ended malformed) the text is passed on as content, as before."""
    calls = [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"y": "z"}}]
    block = cf.render_tool_calls(calls)
    second = block.index(cf.INVOKE_OPEN, block.index(cf.INVOKE_CLOSE))
    cases = [(block[:second - 1], ["a"]),                   # "\n<": the next invoke's start
             (block[:second + len(cf.INVOKE_OPEN) + 12], ["a"]),   # inside the second
             (block[:block.index(cf.PARAM_CLOSE)], []),     # inside the first's parameter
             (block[:5], []), ("", [])]
    for text, names in cases:
        for whole in (True, False):
            parser, reply = ReplyParser(thinking=False), Reply()
            for piece in [("Sure." + text)] if whole else "Sure." + text:
                reply.add(parser.feed(piece))
            reply.add(parser.finish(cut=True))
            assert reply.content == "Sure." and [c["name"] for c in reply.calls] == names, \
                (text, reply)
            assert [json.loads(c["arguments"]) for c in reply.calls] == \
                [c["arguments"] for c in calls[:len(names)]]
    reply = parse_reply("Sure." + block[:second + 20], thinking=False)
    assert cf.DSML in reply.content  # an unconstrained reply's malformed block: raw text
    held = parse_reply("Sure.\n\n<" + cf.DSML[:2], thinking=False, cut=True)
    assert held.content == "Sure." and not held.calls


# ---------------------------------------------------------------- logprobs under a constraint


def post_text(port: int, path: str, body: dict) -> tuple:
    """Raw HTTP POST: (status, the body's text), streamed bodies whole."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    response = conn.getresponse()
    status, text = response.status, response.read().decode()
    conn.close()
    return status, text


def finite_numbers(value) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(finite_numbers(v) for v in value.values())
    if isinstance(value, list):
        return all(finite_numbers(v) for v in value)
    return True


@pytest.mark.slow
def test_logprobs_under_a_constraint_are_finite(chat_mode):
    """logprobs with top_logprobs 5 under a JSON schema and under a forced call: the tokens
    the grammar masked are left out of top_logprobs (often fewer than 5 remain) and no
    number is infinite, whole or streamed."""
    base = {"model": "tiny", "messages": ASK, "max_tokens": LIMIT, "logprobs": True,
            "top_logprobs": 5}
    bodies = [dict(base, response_format=json_format(FLAG)),
              dict(base, tools=[{"type": "function", "function": {"name": "pick",
                                                                   "parameters": PICK}}],
                   tool_choice="required")]
    for body in bodies:
        status, text = post_text(chat_mode.port, "/v1/chat/completions", body)
        assert status == 200, text
        reply = json.loads(text)
        content = reply["choices"][0]["logprobs"]["content"]
        assert content and finite_numbers(reply)
        assert any(len(entry["top_logprobs"]) < 5 for entry in content)
        assert all(entry["logprob"] <= 0 and len(entry["top_logprobs"]) >= 1
                   for entry in content)
        status, text = post_text(chat_mode.port, "/v1/chat/completions",
                                 dict(body, stream=True))
        assert status == 200 and "Infinity" not in text and "NaN" not in text, text[-500:]
        chunks = [json.loads(line[6:]) for line in text.splitlines()
                  if line.startswith("data: {")]
        assert all(finite_numbers(chunk) for chunk in chunks)


# ---------------------------------------------------------------- tokens a reply never holds


@pytest.fixture(scope="module")
def forced(loaded):
    yield from forcing_server(*loaded)


def test_special_tokens_never_reach_a_reply_and_the_next_turn_takes_it(forced):
    """A reply pushed (by the test hook's bias) to write `<｜User｜>`, BOS and the image
    placeholder holds none of them, in chat completions and Responses; the Responses chain
    (previous_response_id) and the reply sent back as an assistant message are accepted
    (the placeholder in stored text was refused with 400)."""
    specials = f"{cf.USER}{cf.BOS}{cf.IMAGE_PLACEHOLDER}{cf.SYSTEM}"
    script = forced.hook.add("specials", f"Hi {specials} there {cf.THINK_START}x",
                             eos=True)
    banned = {forced.engine.tokenizer.convert_tokens_to_ids(t) for t in (
        cf.USER, cf.BOS, cf.IMAGE_PLACEHOLDER, cf.SYSTEM, cf.THINK_START)}
    assert banned <= set(script)
    client = forced.client()
    reply = client.chat.completions.create(model="tiny", messages=ASK, user="specials",
                                           max_tokens=len(script) + 4, extra_body=CHAT)
    text = reply.choices[0].message.content
    assert text.startswith("Hi ") and not any(t in text for t in (
        cf.USER, cf.BOS, cf.IMAGE_PLACEHOLDER, cf.SYSTEM, cf.THINK_START)), text
    again = client.chat.completions.create(
        model="tiny", max_tokens=2, extra_body=CHAT,
        messages=ASK + [{"role": "assistant", "content": text},
                        {"role": "user", "content": "And?"}])
    assert again.choices[0].finish_reason in ("stop", "length")
    first = client.responses.create(model="tiny", input="Hello", user="specials",
                                    max_output_tokens=len(script) + 4,
                                    reasoning={"effort": "none"})
    assert first.output_text.startswith("Hi ") and cf.IMAGE_PLACEHOLDER not in \
        first.output_text
    second = client.responses.create(model="tiny", input="And?", max_output_tokens=2,
                                     previous_response_id=first.id,
                                     reasoning={"effort": "none"})
    assert second.status in ("completed", "incomplete")


# ---------------------------------------------------------------- nested pydantic models








@pytest.mark.slow
def test_nested_pydantic_models_as_tools_and_answers(chat_mode):
    """A forced call of `pydantic_function_tool(Place)` (OpenAI strict mode: `$ref`s into
    `$defs`, refused with 400 "Pointer '/$defs/Point' does not exist" when each parameter
    compiled without the root's definitions) and `Place` as the response_format: the
    client's `parse` returns a `Place` each time."""
    client = chat_mode.client()
    reply = client.chat.completions.parse(
        model="tiny", messages=ASK, max_tokens=LIMIT, tools=[openai.pydantic_function_tool(
            Place)], tool_choice={"type": "function", "function": {"name": "Place"}})
    [call] = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls"
    assert isinstance(call.function.parsed_arguments, Place)
    reply = client.chat.completions.parse(model="tiny", messages=ASK, max_tokens=LIMIT,
                                          response_format=Place)
    assert isinstance(reply.choices[0].message.parsed, Place)
