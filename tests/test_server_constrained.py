"""Constrained decoding through chat completions with the real `openai` client on a live server:
`response_format` json_object / json_schema (and the client's `parse` helper), `tool_choice`
"required" and a named function, streamed and not, several choices (`n`), thinking mode,
the batching engine and --dspark; every output parses and validates (`jsonschema`) on a random
checkpoint, since the grammar, not the weights, guarantees it. Bad schemas and tool names get
OpenAI errors naming the field, and the server stays healthy."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pydantic
import pytest

import mlx_v41
from conftest import golden_checkpoint
from mlx_v41.chat import format as cf
from mlx_v41.server.conversation import with_response_format
from server_harness import LiveServer, get, post, write_swa_checkpoint

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
            "type": "array"}}}], "tool_choice": "required"}, "tools", "object"),
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
    assert get(live.port, "/health") == (200, {"status": "ok"})
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
