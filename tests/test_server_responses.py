"""The Responses API (`/v1/responses`) live on 127.0.0.1 with the tiny golden checkpoint, driven
by the real `openai` client: a string input equal to `mlx_v41.generate`, input items rendered
as the same chat, reasoning and function-call output items (forced on the real model), the
stream's typed events, stored responses (GET, DELETE, `store: false`, the LRU bound), a
function-call round trip through `previous_response_id` whose prompt is the earlier prompt +
reply + the new turn (and the prompt cache's hit), constrained `text.format` and `tool_choice`,
errors naming the field, and a failing request that leaves stores and caches as they were."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

import mlx_v41
from mlx_v41.chat import format as cf
from mlx_v41.cli.server import setup_arg_parser
from mlx_v41.server.responses.store import ResponseStore
from conftest import slow
from server_harness import MODEL_ID, forcing_server, get, post, tiny

pytestmark = pytest.mark.usefixtures("cpu")

CHAT_MODE = {"effort": "none"}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "required": ["city"], "properties": {
               "city": {"type": "string", "maxLength": 8}}}}
CALL_BLOCK = (f'\n\n{cf.CALLS_OPEN}\n{cf.INVOKE_OPEN} name="get_weather">\n'
              f'{cf.PARAM_OPEN} name="city" string="true">Paris{cf.PARAM_CLOSE}\n'
              f'{cf.INVOKE_CLOSE}\n{cf.CALLS_CLOSE}')


@pytest.fixture(scope="module")
def live():
    yield from forcing_server(*tiny())


@pytest.fixture(scope="module")
def client(live):
    return live.client()


def rendered(messages, thinking=False, tools=None, effort=None) -> list:
    """The prompt ids of a chat, as the chat template renders it (what the server must send)."""
    _, tokenizer = tiny()
    return tokenizer.apply_chat_template(messages, tools=tools, enable_thinking=thinking,
                                         reasoning_effort=effort)


def chat_tool(tool: dict) -> dict:
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def token_count(text: str) -> int:
    return len(tiny()[1].encode(text, add_special_tokens=False))


def caches(live) -> list:
    return [(e.state.tokens, e.nbytes) for e in live.store.entries]


# ----------------------------------------------------------------------------- one response

def test_string_input_greedy_equals_generate(live, client):
    model, tokenizer = tiny()
    ids = rendered([{"role": "user", "content": "Hello there"}])
    expected = "".join(r.text for r in mlx_v41.stream_generate(model, tokenizer, ids,
                                                                max_tokens=6))
    reply = client.responses.create(model=MODEL_ID, input="Hello there", max_output_tokens=6,
                                    reasoning=CHAT_MODE)
    assert live.hook.prompts[-1] == ids
    assert reply.object == "response" and reply.id.startswith("resp_")
    assert reply.output_text == expected and [item.type for item in reply.output] == ["message"]
    assert reply.status == "incomplete"
    assert reply.incomplete_details.reason == "max_output_tokens"
    usage = reply.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == \
        (len(ids), 6, len(ids) + 6)
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert reply.max_output_tokens == 6 and reply.store is True and reply.model == MODEL_ID


def test_input_items_render_as_the_chat(live, client):
    """Instructions, developer and system messages, text parts, an earlier assistant turn with
    its reasoning item: the prompt is the chat template's for the same conversation."""
    items = [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"},
                                     {"type": "input_text", "text": "there"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "greet back"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Bonjour"}]},
        {"type": "message", "role": "user", "content": "And now?"}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                     {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "Bonjour", "reasoning_content": "greet back"},
        {"role": "user", "content": "And now?"}]
    client.responses.create(model=MODEL_ID, input=items, instructions="Be brief.",
                            max_output_tokens=1, reasoning={"effort": "max"})
    assert live.hook.prompts[-1] == rendered(messages, thinking=True, effort="max")


@pytest.mark.slow
def test_parallel_function_calls_and_their_outputs_render_as_the_chat(live, client):
    """Consecutive function_call items are one assistant turn; their outputs, in any order,
    are its tool results."""
    call = {"type": "function_call", "name": "get_weather"}
    items = [{"role": "user", "content": "Paris and Rome?"},
             dict(call, call_id="c1", arguments='{"city": "Paris"}'),
             dict(call, call_id="c2", arguments='{"city": "Rome"}'),
             {"type": "function_call_output", "call_id": "c2", "output": "20C"},
             {"type": "function_call_output", "call_id": "c1", "output": [
                 {"type": "input_text", "text": "18C"}]}]
    calls = [{"id": i, "type": "function", "function": {"name": "get_weather", "arguments": a}}
             for i, a in (("c1", '{"city": "Paris"}'), ("c2", '{"city": "Rome"}'))]
    messages = [{"role": "user", "content": "Paris and Rome?"},
                {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "c2", "content": "20C"},
                {"role": "tool", "tool_call_id": "c1", "content": "18C"}]
    client.responses.create(model=MODEL_ID, input=items, tools=[WEATHER], max_output_tokens=1)
    assert live.hook.prompts[-1] == rendered(messages, thinking=True, tools=[chat_tool(WEATHER)])


@pytest.mark.parametrize("effort, thinking, v41", [("none", False, None), ("minimal", True, "low"),
                                                   ("medium", True, "high"),
                                                   ("xhigh", True, "max"), (30, True, 30)])
def test_reasoning_effort_maps_to_the_chat_mode(live, client, effort, thinking, v41):
    client.responses.create(model=MODEL_ID, input="Hi", max_output_tokens=1,
                            reasoning={"effort": effort})
    assert live.hook.prompts[-1] == rendered([{"role": "user", "content": "Hi"}], thinking, None,
                                             v41)


def test_thinking_reply_is_a_reasoning_item_then_a_message(live, client):
    live.hook.add("think", "weigh it" + cf.THINK_END + "Sunny")
    reply = client.responses.create(model=MODEL_ID, input="Weather?", user="think")
    reasoning, message = reply.output
    assert reasoning.type == "reasoning" and reasoning.summary == []
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", "weigh it")]
    assert message.type == "message" and message.role == "assistant"
    assert [(c.type, c.text) for c in message.content] == [("output_text", "Sunny")]
    assert reply.output_text == "Sunny" and reply.status == "completed"
    assert reply.incomplete_details is None
    usage = reply.usage
    assert usage.output_tokens == token_count("weigh it" + cf.THINK_END + "Sunny") + 1  # EOS
    assert usage.output_tokens_details.reasoning_tokens == token_count("weigh it" + cf.THINK_END)


@pytest.mark.slow
def test_tool_choice_none_masks_the_call_block(live, client):
    live.hook.add("call", "look it up" + cf.THINK_END + CALL_BLOCK)
    client.responses.create(model=MODEL_ID, input="Weather in Paris?", user="call",
                            tools=[WEATHER], max_output_tokens=1)
    banned = client.responses.create(model=MODEL_ID, input="Weather in Paris?", user="call",
                                     tools=[WEATHER], tool_choice="none", max_output_tokens=40)
    assert "function_call" not in [item.type for item in banned.output]
    assert live.hook.prompts[-1] == live.hook.prompts[-2]  # the tools stay in the prompt


# ----------------------------------------------------------------------------- streaming

def test_streamed_events_build_the_response(live, client):
    live.hook.add("stream", "why not" + cf.THINK_END + "Hi there")
    with client.responses.stream(model=MODEL_ID, input="Hello", user="stream") as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    first_message = kinds.index("response.output_text.delta")
    assert kinds[first_message - 5:first_message] == [
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_item.added",
        "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (reasoning, text) == ("why not", "Hi there")
    assert final.output_text == "Hi there" and final.status == "completed"
    assert final.output[0].content[0].text == "why not"
    assert client.responses.retrieve(final.id).output_text == "Hi there"


@pytest.mark.slow
def test_streamed_function_call(live, client):
    live.hook.add("call", "look it up" + cf.THINK_END + CALL_BLOCK)
    events = list(client.responses.create(model=MODEL_ID, input="Weather in Paris?",
                                          user="call", tools=[WEATHER], stream=True))
    arguments = "".join(e.delta for e in events
                        if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(arguments) == {"city": "Paris"} and done[0].arguments == arguments
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [item.type for item in added] == ["reasoning", "function_call"]
    assert added[1].name == "get_weather"
    assert events[-1].type == "response.completed"
    assert events[-1].response.output[1].call_id == added[1].call_id


# ----------------------------------------------------------------------------- stored responses

@pytest.mark.slow
def test_function_call_round_trip_hits_the_prompt_cache(live, client):
    """The second turn sends only the function_call_output: its prompt is the first prompt,
    the first reply and the new turn, and the cache holds all of the first two."""
    live.hook.add("call", "look it up" + cf.THINK_END + CALL_BLOCK)
    first = client.responses.create(model=MODEL_ID, input="Weather in Paris?", user="call",
                                    tools=[WEATHER])
    call = first.output[-1]
    assert [item.type for item in first.output] == ["reasoning", "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and first.status == "completed"
    assert first.tools[0].name == "get_weather" and first.tool_choice == "auto"
    reply_ids = live.hook.scripts["call"]
    first_prompt = live.hook.prompts[-1]
    live.hook.add("answer", "easy" + cf.THINK_END + "Sunny, 18C")
    second = client.responses.create(
        model=MODEL_ID, previous_response_id=first.id, user="answer", tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18C"}])
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "reasoning_content": "look it up",
                 "tool_calls": [{"id": "c1", "type": "function", "function": {
                     "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "18C"}]
    prompt = live.hook.prompts[-1]
    assert prompt == rendered(messages, thinking=True, tools=[chat_tool(WEATHER)])
    assert prompt[:len(first_prompt) + len(reply_ids)] == first_prompt + reply_ids
    assert second.usage.input_tokens_details.cached_tokens == len(first_prompt) + len(reply_ids)
    assert second.output_text == "Sunny, 18C" and second.previous_response_id == first.id
    # a third turn after a plain message goes on from the second's stored conversation
    third = client.responses.create(model=MODEL_ID, previous_response_id=second.id,
                                    tools=[WEATHER], input="Thanks", max_output_tokens=1)
    assert third.usage.input_tokens_details.cached_tokens == \
        second.usage.input_tokens + second.usage.output_tokens


def test_thinking_without_tools_resumes_from_the_earlier_prompt(live, client):
    """The chat format drops an earlier turn's reasoning (no tools): the next prompt renders
    `</think>` where the earlier one ended with `<think>`, so its cache covers all but that."""
    live.hook.add("plain", "hmm" + cf.THINK_END + "Hello")
    first = client.responses.create(model=MODEL_ID, input="Hi", user="plain")
    second = client.responses.create(model=MODEL_ID, input="Again", max_output_tokens=1,
                                     previous_response_id=first.id)
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello", "reasoning_content": "hmm"},
                {"role": "user", "content": "Again"}]
    assert live.hook.prompts[-1] == rendered(messages, thinking=True)
    assert second.usage.input_tokens_details.cached_tokens == first.usage.input_tokens - 1


def test_retrieve_delete_and_store_false(client):
    reply = client.responses.create(model=MODEL_ID, input="Hi", max_output_tokens=2)
    assert client.responses.retrieve(reply.id).model_dump() == reply.model_dump()
    client.responses.delete(reply.id)
    for action in (client.responses.retrieve, client.responses.delete):
        with pytest.raises(openai.NotFoundError):
            action(reply.id)
    unstored = client.responses.create(model=MODEL_ID, input="Hi", max_output_tokens=2,
                                       store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model=MODEL_ID, input="Hi", previous_response_id=unstored.id)
    assert error.value.body["param"] == "previous_response_id"
    assert error.value.body["code"] == "previous_response_not_found"


def test_the_store_keeps_the_most_recently_used(live, client):
    saved = live.app.state.responses
    live.app.state.responses = ResponseStore(2)
    try:
        ids = [client.responses.create(model=MODEL_ID, input="Hi", max_output_tokens=1).id
               for _ in range(2)]
        client.responses.retrieve(ids[0])  # now the most recently used
        ids.append(client.responses.create(model=MODEL_ID, input="Hi", max_output_tokens=1).id)
        assert [get(live.port, f"/v1/responses/{i}")[0] for i in ids] == [200, 404, 200]
    finally:
        live.app.state.responses = saved


# ----------------------------------------------------------------------------- errors

def test_max_stored_responses_flag():
    parser = setup_arg_parser()
    assert parser.parse_args(["--model", "m", "--max-stored-responses", "3"]
                             ).max_stored_responses == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--max-stored-responses", "-1"])


CALL_ITEM = {"type": "function_call", "call_id": "c1", "name": "get_weather",
             "arguments": '{"city": "Paris"}'}
BAD_BODIES = [
    ({"input": "hi", "previous_response_id": "resp_nope"}, 400, "previous_response_id",
     "not found"),
    ({"input": [{"role": "user", "content": "hi"}, CALL_ITEM,
                {"type": "function_call_output", "call_id": "c2", "output": "x"}]}, 400,
     "input[2].call_id", "no function_call"),
    ({"input": [{"role": "user", "content": "hi"}, dict(CALL_ITEM, arguments="[1]")]}, 400,
     "input[1].arguments", "not a JSON object"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     400, "tool_choice", "nope"),
    ({"input": "hi", "tool_choice": "required"}, 400, "tool_choice", "needs tools"),
    ({"input": "hi", "tool_choice": {"type": "allowed_tools"}}, 400, "tool_choice",
     "not supported"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools[0].type",
     "'web_search' tools are not supported"),
    ({"input": "hi", "tools": [{"type": "function"}]}, 400, "tools[0].name", "required"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "input[0].type", "not supported"),
    ({"input": [{"role": "tool", "content": "x"}]}, 400, "input[0].role", "Input should be"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, 400,
     "input[0].content[0].type", "not supported"),
    ({"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]}, 400,
     "input[0].content[0]", "not an image"),
    ({"input": []}, 400, "input", "no input items"),
    ({"input": "hi", "reasoning": {"effort": "huge"}}, 400, "reasoning.effort", "huge"),
    ({"input": "hi", "max_output_tokens": "5"}, 400, "max_output_tokens", "valid integer"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, 400, "text.format.type", "'text'"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400,
     "text.format.schema", "JSON schema"),
    ({"input": "hi", "background": True}, 400, "background", "not supported"),
    ({"input": "hi", "model": "gpt-9"}, 404, "model", "does not exist"),
    ({"input": "hi \ud800"}, 400, "input", "lone surrogate"),
    (["hi"], 400, None, "JSON object"),
]


@pytest.mark.parametrize("body, status, param, words", BAD_BODIES)
def test_bad_input_is_an_openai_error(live, body, status, param, words):
    entries, stored = caches(live), len(live.app.state.responses)
    code, reply = post(live.port, "/v1/responses", body)
    assert code == status, reply
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"} and words in error["message"]
    assert error["param"] == param
    assert caches(live) == entries and len(live.app.state.responses) == stored


@pytest.mark.slow
def test_a_failing_request_leaves_the_server_healthy(live, client):
    live.hook.scripts["boom"] = RuntimeError("boom in a processor")
    entries, stored = caches(live), len(live.app.state.responses)
    with pytest.raises(openai.InternalServerError, match="boom in a processor"):
        client.responses.create(model=MODEL_ID, input="fail, please", user="boom")
    events = list(client.responses.create(model=MODEL_ID, input="fail, please", user="boom",
                                          stream=True))
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert "boom in a processor" in events[-2].message
    assert events[-1].response.status == "failed"
    assert "boom in a processor" in events[-1].response.error.message
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(events[-1].response.id)
    assert caches(live) == entries and len(live.app.state.responses) == stored
    assert get(live.port, "/health")[0] == 200
    assert client.responses.create(model=MODEL_ID, input="ok", max_output_tokens=1).usage


# ----------------------------------------------------------------------------- constraints

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog"]}}}


@pytest.mark.parametrize("seed", [0, slow(1), slow(2)])
@pytest.mark.slow
def test_json_schema_answer_validates(client, seed):
    reply = client.responses.create(
        model=MODEL_ID, input="A person, please.", reasoning=CHAT_MODE, temperature=1.0,
        max_output_tokens=200, extra_body={"seed": seed},
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                         "strict": True}})
    assert reply.status == "completed"
    jsonschema.validate(json.loads(reply.output_text), PERSON)
    assert reply.text.format.type == "json_schema"


def test_the_format_is_rendered_into_the_system_message(live, client):
    """As the official encoding renders a response format: the model is told the schema."""
    text_format = {"type": "json_object"}
    client.responses.create(model=MODEL_ID, input="JSON, please.", reasoning=CHAT_MODE,
                            max_output_tokens=1, text={"format": text_format})
    prompt = live.engine.tokenizer.decode(live.hook.prompts[-1])
    assert prompt.startswith(cf.BOS + cf.SYSTEM + cf.RESPONSE_FORMAT_HEAD + json.dumps(
        text_format) + cf.USER + "JSON, please.")


def test_json_object_answer_after_reasoning(live, client):
    """Thinking mode: the reasoning is free (here forced), the answer after it is JSON."""
    live.hook.add("brief", "ok" + cf.THINK_END, eos=False)
    reply = client.responses.create(model=MODEL_ID, input="JSON, please.", user="brief",
                                    max_output_tokens=120, reasoning={"effort": "low"},
                                    text={"format": {"type": "json_object"}})
    assert [item.type for item in reply.output] == ["reasoning", "message"]
    assert reply.output[0].content[0].text == "ok" and reply.status == "completed"
    assert isinstance(json.loads(reply.output_text), dict)


@pytest.mark.parametrize("choice", [slow("required"),
                                    {"type": "function", "name": "get_weather"}])
@pytest.mark.slow
def test_forced_function_call(live, client, choice):
    """After a (forced) reasoning, the grammar writes the call (the prompt is the round trip's
    first, which the prompt cache holds)."""
    live.hook.add("brief", "ok" + cf.THINK_END, eos=False)
    reply = client.responses.create(model=MODEL_ID, input="Weather in Paris?", tools=[WEATHER],
                                    tool_choice=choice, parallel_tool_calls=False,
                                    user="brief", temperature=1.0,
                                    max_output_tokens=300, extra_body={"seed": 5})
    calls = [item for item in reply.output if item.type == "function_call"]
    assert reply.status == "completed" and reply.output[0].type == "reasoning"
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])


def test_a_schema_the_grammar_library_refuses(live):
    body = {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                               "schema": {"type": "nonsense"}}}}
    code, reply = post(live.port, "/v1/responses", body)
    assert code == 400 and reply["error"]["param"] == "text.format.schema", reply
