"""Request validation across the three APIs, live on the tiny model: the OpenAPI schema declares
every body; null is every optional field's default; bodies that used to crash the server are
400s; errors name the client's own field in each API's spelling; OpenAI's ranges and rules;
the headers of 405 and 429; Anthropic's `thread` refused so that the SDK's tool runner sends
the whole conversation."""

from __future__ import annotations

import http.client
import json
import threading

import anthropic
import pytest

from mlx_v41.chat import format as cf
from mlx_v41.server.anthropic import protocol as ap
from mlx_v41.server.bodies import schema_of
from mlx_v41.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from mlx_v41.server.responses.protocol import ResponsesRequest
from server_harness import MODEL_ID, LiveServer, forcing_server, get, post, tiny

pytestmark = pytest.mark.usefixtures("cpu")

CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
MESSAGES, COUNT = "/v1/messages", "/v1/messages/count_tokens"
HI = [{"role": "user", "content": "hi"}]
OFF = {"chat_template_kwargs": {"thinking": False}}
PLACEHOLDER = cf.IMAGE_PLACEHOLDER
TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "string"}}}}}
FLAT_TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}
ANTHROPIC_TOOL = {"name": "f", "input_schema": {"type": "object"}}
REQUESTS = {CHAT: ChatCompletionRequest, COMPLETIONS: CompletionRequest,
            RESPONSES: ResponsesRequest, MESSAGES: ap.MessagesRequest, COUNT: ap.CountTokensRequest}


@pytest.fixture(scope="module")
def live():
    yield from forcing_server(*tiny())


def request(port: int, method: str, path: str, body=None) -> tuple:
    """(status, headers, decoded JSON body) of one raw request."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    data = None if body is None else body if isinstance(body, bytes) else json.dumps(body)
    conn.request(method, path, data, {"Content-Type": "application/json"})
    response = conn.getresponse()
    status, headers, raw = response.status, dict(response.getheaders()), response.read()
    conn.close()
    return status, headers, json.loads(raw)


def openai_error(live, path: str, body) -> dict:
    status, reply = post(live.port, path, body)
    assert status == 400, reply
    return reply["error"]


def anthropic_message(live, path: str, body) -> str:
    status, reply = post(live.port, path, body)
    assert status == 400 and reply["type"] == "error", reply
    return reply["error"]["message"]


# ----------------------------------------------------------------------------- the schema

def test_openapi_declares_every_body_and_answer(live):
    status, spec = get(live.port, "/openapi.json")
    assert status == 200
    for path, model in REQUESTS.items():
        operation = spec["paths"][path]["post"]
        declared, schema = (operation["requestBody"]["content"]["application/json"]["schema"],
                            schema_of(model))
        assert set(declared["properties"]) == set(schema["properties"])
        assert declared.get("required") == schema.get("required")
        answers = operation["responses"]
        assert {"200", "400", "404", "500"} <= set(answers) and "422" not in answers
        error = "AnthropicError" if path.startswith(MESSAGES) else "ErrorBody"
        assert answers["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "/" + error)
        assert ("text/event-stream" in answers["200"]["content"]) == (path != COUNT)
    for method in ("get", "delete"):
        assert "422" not in spec["paths"]["/v1/responses/{response_id}"][method]["responses"]


def nullable(schema: dict) -> bool:
    """Whether a JSON schema takes null: it says nothing of the type, or null is one."""
    is_any = not {"type", "anyOf", "oneOf", "allOf", "const", "enum"} & set(schema)
    return is_any or any(kind.get("type") == "null" for kind in schema.get("anyOf", []))


def optional_fields(schema, where: str = ""):
    """(location, schema) of every field of every object in a JSON schema that may be left
    out."""
    if isinstance(schema, list):
        for item in schema:
            yield from optional_fields(item, where)
        return
    if not isinstance(schema, dict):
        return
    for name, field in schema.get("properties", {}).items():
        if name not in schema.get("required", []):
            yield f"{where}.{name}", field
        yield from optional_fields(field, f"{where}.{name}")
    for key in ("anyOf", "items"):
        yield from optional_fields(schema.get(key), where)


@pytest.mark.parametrize("path", list(REQUESTS))
def test_every_optional_field_may_be_null(path):
    fields = list(optional_fields(schema_of(REQUESTS[path])))
    assert len(fields) > 10
    assert [where for where, field in fields if not nullable(field)] == []


@pytest.mark.slow
def test_null_is_the_default(live):
    status, reply = post(live.port, CHAT, {
        "messages": HI, "max_tokens": 1, "stream": None, "n": None, "parallel_tool_calls": None,
        "logprobs": None, "echo": None, "stream_options": None, "tools": [TOOL],
        "tool_choice": None, "temperature": None, "seed": None, **OFF})
    assert status == 200 and len(reply["choices"]) == 1, reply
    status, reply = post(live.port, RESPONSES, {
        "input": "hi", "max_output_tokens": 1, "stream": None, "store": None,
        "parallel_tool_calls": None, "text": {"format": None}, "reasoning": {"effort": None}})
    assert status == 200 and reply["store"] and reply["parallel_tool_calls"], reply
    status, reply = post(live.port, MESSAGES, {
        "max_tokens": 1, "messages": HI, "stream": None, "tools": [ANTHROPIC_TOOL],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": None}, "system": None})
    assert status == 200 and reply["type"] == "message", reply


# ----------------------------------------------------------------------------- were 500s

@pytest.mark.parametrize("path", [MESSAGES, COUNT])
def test_an_empty_anthropic_content_is_a_400(live, path):
    body = {"max_tokens": 1, "messages": [{"role": "user", "content": []}]}
    assert anthropic_message(live, path, body).startswith("messages.0.content: all messages")
    final = {"role": "assistant", "content": []}  # Anthropic allows this one
    status, reply = post(live.port, COUNT, {"messages": HI + [final]})
    assert status == 200 and reply["input_tokens"] > 0


def test_a_lone_surrogate_in_call_arguments_is_a_400(live):
    arguments = '{"a": "\\ud800"}'  # JSON text whose string decodes to a lone surrogate
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    error = openai_error(live, CHAT, {"messages": HI + [
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "x"}], "tools": [TOOL]})
    assert error["param"] == "messages[1].tool_calls[0].function.arguments.a"
    assert "lone surrogate U+D800" in error["message"]
    error = openai_error(live, RESPONSES, {"input": [
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": arguments}]})
    assert error["param"] == "input[1].arguments.a"


@pytest.mark.parametrize("path", [CHAT, RESPONSES, MESSAGES])
def test_a_body_nested_too_deep_is_a_400(live, path):
    depth = 100_000
    status, reply = post(live.port, path, b'{"messages": ' + b"[" * depth + b"]" * depth + b"}")
    assert status == 400
    error = reply["error"]
    assert "nested too deeply" in error["message"] and "body" in error["message"]
    assert error["type"] == "invalid_request_error"
    assert ("param" in error) == (path != MESSAGES)  # each API's own shape


# ----------------------------------------------------------------------------- locations

@pytest.mark.parametrize("fields", [{"tools": [TOOL]},
                                    {"response_format": {"type": "json_object"}}])
def test_chat_errors_name_the_clients_index(live, fields):
    """Tools and a response format put the server's own system message first: errors still
    count the client's messages."""
    error = openai_error(live, CHAT, {"messages": HI + [
        {"role": "user", "content": [{"type": "text", "text": f"see {PLACEHOLDER}"}]}],
        **fields})
    assert error["param"] == "messages[1].content[0].text"
    assert error["message"].startswith("messages[1].content[0].text: text holds the literal "
                                       "image placeholder")
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[1]"}}
    error = openai_error(live, CHAT, {"messages": HI + [
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c2", "content": "x"}], **fields})
    assert error["param"] == "messages[1].tool_calls[0].function.arguments"
    call["function"]["arguments"] = "{}"
    error = openai_error(live, CHAT, {"messages": HI + [
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c2", "content": "x"}], **fields})
    assert error["param"] == "messages[2].tool_call_id"


def test_errors_name_the_clients_index_under_a_system_prompt():
    model, tokenizer = tiny()
    server = LiveServer(model, tokenizer, system_prompt="Be brief.")
    try:
        error = openai_error(server, CHAT, {"messages": [
            {"role": "user", "content": f"see {PLACEHOLDER}"}]})
        assert error["param"] == "messages[0].content"
        error = openai_error(server, RESPONSES, {"input": [
            {"role": "user", "content": f"see {PLACEHOLDER}"}]})
        assert error["param"] == "input[0].content"
    finally:
        server.close()


def test_responses_errors_name_the_input(live):
    error = openai_error(live, RESPONSES, {"input": [
        {"role": "user", "content": [{"type": "input_text", "text": PLACEHOLDER}]}],
        "tools": [FLAT_TOOL]})
    assert error["param"] == "input[0].content[0].text"
    error = openai_error(live, RESPONSES, {"input": [
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{\"a\": 1}"},
        {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text"}]}]})
    assert error["param"] == "input[2].output[0].type"
    error = openai_error(live, RESPONSES, {"input": [{"type": ["message"]}]})
    assert error["param"] == "input[0].type"


def test_anthropic_errors_are_dotted(live):
    result = {"type": "tool_result", "tool_use_id": "t1", "content": [
        {"type": "text", "text": PLACEHOLDER}]}
    message = anthropic_message(live, MESSAGES, {"max_tokens": 1, "messages": HI + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f",
                                           "input": {}}]},
        {"role": "user", "content": [result]}], "tools": [ANTHROPIC_TOOL]})
    assert message.startswith("messages.2.content.0.content.0.text: text holds the literal")
    message = anthropic_message(live, MESSAGES, {"max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"}]}]})
    assert message == "messages.0.content.1.text: Field required"


@pytest.mark.parametrize("body, param, words", [
    ({"messages": HI, "stop": 5}, "stop", "stop: Input should be a valid string or a valid list"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content",
     "messages[0].content: Input should be a valid string or a valid list"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content[0].text", "messages[0].content[0].text: Input should be a valid str"),
    ({"messages": HI, "tool_choice": 5}, "tool_choice", "tool_choice: Input should be"),
])
def test_union_members_are_not_named(live, body, param, words):
    error = openai_error(live, CHAT, body)
    assert error["param"] == param and error["message"].startswith(words)


# ----------------------------------------------------------------------------- OpenAI's rules

@pytest.mark.parametrize("path, body, param, words", [
    (CHAT, {"echo": True}, "echo", "echo is not supported"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}]}, "tools[0].function.parameters", "type 'object', got type 'string'"),
    (CHAT, {"temperature": 100}, "temperature", "less than or equal to 2"),
    (CHAT, {"presence_penalty": 1000}, "presence_penalty", "less than or equal to 2"),
    (CHAT, {"frequency_penalty": -3}, "frequency_penalty", "greater than or equal to -2"),
    (CHAT, {"logit_bias": {"5": 1000}}, "logit_bias.5", "less than or equal to 100"),
    (CHAT, {"repetition_penalty": 1e-300}, "repetition_penalty", "greater than or equal to"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": ""}}]},
     "tools[0].function.name", "at least 1 character"),
    (CHAT, {"tools": [TOOL, TOOL]}, "tools[1].function.name", "another tool is named 'f'"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "get weather"}}]},
     "tools[0].function.name", "'get weather' is not a tool name"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f" * 65}}]},
     "tools[0].function.name", "at most 64 characters"),
    (CHAT, {"stream_options": {"include_usage": True}}, "stream_options",
     "stream_options is only allowed when stream is true"),
    (CHAT, {"n": 1.5}, "n", "valid integer"),
    (COMPLETIONS, {"prompt": "hi", "echo": True}, "echo", "echo is not supported"),
    (RESPONSES, {"input": "hi", "tools": [FLAT_TOOL, FLAT_TOOL]}, "tools[1].name",
     "another tool is named 'f'"),
    (RESPONSES, {"input": "hi", "tools": [dict(FLAT_TOOL, name="")]}, "tools[0].name",
     "at least 1 character"),
    (RESPONSES, {"input": "hi", "tools": [dict(FLAT_TOOL, name="a.b")]}, "tools[0].name",
     "'a.b' is not a tool name"),
    (RESPONSES, {"input": "hi", "tools": [dict(FLAT_TOOL, parameters={"type": "array"})]},
     "tools[0].parameters", "type 'object'"),
])
def test_openai_rules(live, path, body, param, words):
    base = {} if "prompt" in body or "input" in body else {"messages": HI}
    error = openai_error(live, path, {**base, **body})
    assert error["param"] == param and words in error["message"], error


@pytest.mark.parametrize("tools, words", [
    ([ANTHROPIC_TOOL, ANTHROPIC_TOOL], "tools.1.name: another tool is named 'f'"),
    ([dict(ANTHROPIC_TOOL, name="")], "tools.0.name: String should have at least 1 character"),
    ([dict(ANTHROPIC_TOOL, name="f<")], "tools.0.name: 'f<' is not a tool name"),
    ([dict(ANTHROPIC_TOOL, name="f" * 129)], "tools.0.name: 'fff"),
])
def test_anthropic_tool_names(live, tools, words):
    assert anthropic_message(live, COUNT, {"messages": HI, "tools": tools}).startswith(words)


@pytest.mark.slow
def test_the_longest_tool_names_each_api_allows_are_accepted(live):
    """OpenAI's 64 characters; Anthropic's 128."""
    tool = {"type": "function", "function": {"name": "a-Z_9" * 12 + "abcd"}}
    assert post(live.port, CHAT, {"messages": HI, "max_tokens": 1, "tools": [tool]})[0] == 200
    status, reply = post(live.port, COUNT, {"messages": HI, "tools": [
        dict(ANTHROPIC_TOOL, name="x" * 128)]})
    assert status == 200, reply


def completion_text(live, **fields) -> str:
    status, reply = post(live.port, COMPLETIONS, {"prompt": "Once upon", "max_tokens": 4,
                                                  **fields})
    assert status == 200, reply
    return reply["choices"][0]["text"]


@pytest.mark.slow
def test_openai_ranges_accepted(live):
    """Seeds are OpenAI's int64 (a negative one samples as seed + 2**64), top_p 0 is the most
    likely token alone (greedy), and a whole number may be written 2.0."""
    sampled = completion_text(live, temperature=1.0, seed=2**64 - 1)
    assert completion_text(live, temperature=1.0, seed=-1) == sampled
    assert completion_text(live, temperature=1.0, seed=-2**63) == \
        completion_text(live, temperature=1.0, seed=2**63)
    assert completion_text(live, temperature=1.0, top_p=0) == completion_text(live)
    status, reply = post(live.port, CHAT, {"messages": HI, "n": 2.0, "max_tokens": 1.0, **OFF})
    assert status == 200 and len(reply["choices"]) == 2, reply


def test_refusal_fields(live):
    """`refusal: null` on the message and on logprobs (streamed too); an assistant's refusal
    part is sent back as its text."""
    status, reply = post(live.port, CHAT, {"messages": HI, "max_tokens": 2, "logprobs": True,
                                           **OFF})
    choice = reply["choices"][0]
    assert choice["message"]["refusal"] is None and choice["logprobs"]["refusal"] is None
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=60)
    conn.request("POST", CHAT, json.dumps({"messages": HI, "max_tokens": 2, "logprobs": True,
                                           "stream": True, **OFF}))
    events = [json.loads(line[6:]) for line in conn.getresponse().read().decode().splitlines()
              if line.startswith("data: {")]
    conn.close()
    logprobs = [e["choices"][0]["logprobs"] for e in events if e["choices"]]
    assert any(logprobs) and all(lp["refusal"] is None for lp in logprobs if lp)
    refused = [{"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]}]
    said = [{"role": "assistant", "content": "No."}]
    prompts = []
    for answer in (refused, said):
        status, reply = post(live.port, CHAT, {"messages": HI + answer + HI, "max_tokens": 1})
        assert status == 200, reply
        prompts.append(live.hook.prompts[-1])
    assert prompts[0] == prompts[1]
    error = openai_error(live, CHAT, {"messages": [
        {"role": "user", "content": [{"type": "refusal", "refusal": "No."}]}]})
    assert error["param"] == "messages[0].content[0]"


def test_responses_usage_has_cache_write_tokens(live):
    status, reply = post(live.port, RESPONSES, {"input": "hi", "max_output_tokens": 1})
    assert status == 200 and reply["usage"]["input_tokens_details"] == {
        "cached_tokens": reply["usage"]["input_tokens_details"]["cached_tokens"],
        "cache_write_tokens": 0}


# ----------------------------------------------------------------------------- headers

@pytest.mark.parametrize("method, path, allow", [
    ("PATCH", "/v1/responses/resp_1", "DELETE, GET"), ("GET", CHAT, "POST"),
    ("PUT", MESSAGES, "POST"), ("POST", "/v1/models", "GET")])
def test_405_names_the_allowed_methods(live, method, path, allow):
    status, headers, reply = request(live.port, method, path, {})
    assert status == 405 and headers["allow"] == allow
    assert reply["type" if path == MESSAGES else "error"]


def test_429_says_when_to_retry(live):
    results = []

    def one():
        results.append(post(live.port, COMPLETIONS, {"prompt": "q", "max_tokens": 1}))

    with live.engine.lock:  # nothing runs: the requests pile up in the queue
        threads = [threading.Thread(target=one) for _ in range(live.engine.max_concurrent)]
        for t in threads:
            t.start()
        while live.engine.in_flight < live.engine.max_concurrent:
            threading.Event().wait(0.01)
        status, headers, reply = request(live.port, "POST", COMPLETIONS,
                                         {"prompt": "q", "max_tokens": 1})
    for t in threads:
        t.join()
    assert status == 429 and reply["error"]["code"] == "server_busy"
    assert int(headers["retry-after"]) >= 1


# ----------------------------------------------------------------------------- Anthropic thread

def test_a_thread_is_refused_with_its_error_code(live):
    status, reply = post(live.port, MESSAGES, {
        "max_tokens": 1, "messages": HI, "thread": {"type": "create"}})
    assert status == 400 and reply["error"]["type"] == "invalid_request_error"
    assert reply["error"]["details"] == {"error_code": ap.THREAD_UNSUPPORTED}
    status, reply = post(live.port, MESSAGES, {"max_tokens": 1, "messages": HI, "thread": None})
    assert status == 200, reply


SWITCH_CALL = (f'\n\n{cf.CALLS_OPEN}\n{cf.INVOKE_OPEN} name="switch">\n{cf.PARAM_OPEN} '
               f'name="on" string="false">true{cf.PARAM_CLOSE}\n{cf.INVOKE_CLOSE}\n'
               f'{cf.CALLS_CLOSE}')


@pytest.mark.slow
def test_the_sdk_tool_runner_sends_the_whole_conversation(live):
    """The runner offers a thread, is refused, and sends every turn in full: turn 2 holds
    turn 1's call and the tool's result (and its prompt cache serves turn 1)."""
    calls = []

    @anthropic.beta_tool
    def switch(on: bool) -> str:
        """Turn the light on or off.

        Args:
            on: whether the light is on.
        """
        calls.append(on)
        return "the light is on"

    live.hook.add("switch", SWITCH_CALL)
    client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{live.port}", api_key="unused",
                                 max_retries=0)
    runner = client.beta.messages.tool_runner(
        model=MODEL_ID, max_tokens=150, tools=[switch], tool_choice={"type": "any"},
        thinking={"type": "disabled"}, metadata={"user_id": "switch"},
        messages=[{"role": "user", "content": "Light on"}], max_iterations=2)
    replies = list(runner)
    assert [reply.stop_reason for reply in replies] == ["tool_use", "tool_use"]
    assert calls[:2] == [True, True]
    last = live.engine.tokenizer.decode(live.hook.prompts[-1])
    assert cf.CALLS_CLOSE + cf.EOS + cf.USER + "<tool_result>the light is on</tool_result>" in last
    assert replies[1].usage.cache_read_input_tokens > 0
