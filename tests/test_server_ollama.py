"""Ollama's API on `mlx_v41.server`, driven by the real `ollama` client and raw HTTP: greedy
chat and generate replies equal `mlx_v41.stream_generate` (streamed NDJSON lines concatenate
to them), `think`, tool calls and their round trip, `format` (a schema or "json") validated
and ended, images, `options` (num_predict, stop, seed, top_k), the model listings, errors in
Ollama's shape (mid-stream too), API keys and the metrics' route labels. One server on a
2-layer sliding-window checkpoint (fast decode) with a small vision tower serves them all."""

from __future__ import annotations

import base64
import http.client
import json
import time
from types import SimpleNamespace

import jsonschema
import ollama
import pytest

import mlx_v41
from conftest import reference_ops
from mlx_v41.chat import format as cf
from mlx_v41.server.ollama import models as om
from server_harness import MODEL_ID, Forcing, LiveServer, call, write_swa_checkpoint
from vision_fixtures import SMALL_MIN_PIXELS, twin_images

pytestmark = pytest.mark.usefixtures("cpu")

HELLO = [{"role": "user", "content": "Hello there"}]
RECORD = {"type": "object", "additionalProperties": False, "required": ["id", "ok"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"},
                         "tag": {"type": "string", "maxLength": 4}}}
TOOL = {"type": "function", "function": {
    "name": "f", "description": "A function.",
    "parameters": {"type": "object", "required": ["a"], "properties": {
        "a": {"type": "integer"}}}}}
CALL = (f"\n\n{cf.CALLS_OPEN}\n{cf.INVOKE_OPEN} name=\"f\">\n{cf.PARAM_OPEN} name=\"a\" "
        f"string=\"false\">7{cf.PARAM_CLOSE}\n{cf.INVOKE_CLOSE}\n{cf.CALLS_CLOSE}")
KEY = "sk-ollama-test"


class ByText(Forcing):
    """`Forcing` keyed by a request's last text (Ollama's bodies carry no `user`): the prompt
    of a generate request, the last message's content of a chat."""

    def __call__(self, request, prompt):
        text = request.prompt if hasattr(request, "prompt") else request.messages[-1].content
        return super().__call__(SimpleNamespace(user=text), prompt)


def sleeping(seconds: float):
    """A processor that pauses once, before the first token (a long prefill's silence)."""
    def processor(history, logits):
        if not processor.slept:
            time.sleep(seconds)
            processor.slept = True
        return logits
    processor.slept = False
    return processor


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """The sliding-window checkpoint, its images' spans kept small (3 x 4 cells a twin)."""
    folder = write_swa_checkpoint(tmp_path_factory.mktemp("swa") / "hf")
    config = json.loads((folder / "config.json").read_text())
    config["vision_config"]["min_pixels"] = SMALL_MIN_PIXELS
    (folder / "config.json").write_text(json.dumps(config))
    model, tokenizer = mlx_v41.load(folder, dspark=False)
    return reference_ops(model), tokenizer


@pytest.fixture(scope="module")
def live(loaded):
    server = LiveServer(*loaded, hook=ByText(loaded[1]))
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(live):
    return ollama.Client(host=f"http://127.0.0.1:{live.port}")


def reference(loaded, messages, max_tokens, thinking=False) -> tuple:
    """(text, prompt length) of `stream_generate`'s greedy run on the same chat."""
    model, tokenizer = loaded
    ids = tokenizer.apply_chat_template(messages, enable_thinking=thinking)
    return run(loaded, ids, max_tokens), len(ids)


def run(loaded, ids, max_tokens, **kwargs) -> str:
    return "".join(r.text for r in mlx_v41.stream_generate(*loaded, ids, max_tokens=max_tokens,
                                                            **kwargs))


def rendered(live) -> str:
    return live.engine.tokenizer.decode(live.hook.prompts[-1])


def ndjson(live, path: str, body: dict) -> tuple:
    """(content type, each line's JSON) of a streamed request, sent raw."""
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    text = response.read().decode()
    conn.close()
    assert text.endswith("\n")
    return response.getheader("content-type"), [json.loads(x) for x in text.splitlines()]


def check_end(body, prompt_tokens: int, tokens=None, reason="length", model=MODEL_ID) -> None:
    """The last body's fields: the model's name as the request spelled it, done, its reason
    and Ollama's counts and durations."""
    assert body.done and body.done_reason == reason and body.model == model
    assert body.prompt_eval_count == prompt_tokens
    assert tokens is None or body.eval_count == tokens
    durations = [body.load_duration, body.prompt_eval_duration, body.eval_duration]
    assert all(isinstance(d, int) and d >= 0 for d in durations)
    assert body.total_duration >= body.prompt_eval_duration + body.eval_duration > 0
    assert body.created_at.endswith("Z")


# ----------------------------------------------------------------------------- replies

def test_chat_greedy_reply_equals_generate_and_its_stream(live, loaded, client):
    text, prompt_tokens = reference(loaded, HELLO, 6)
    reply = client.chat(model=MODEL_ID, messages=HELLO, think=False,
                        options={"num_predict": 6})
    assert reply.message.role == "assistant" and reply.message.content == text
    assert reply.message.thinking is None and reply.message.tool_calls is None
    check_end(reply, prompt_tokens, 6)
    chunks = list(client.chat(model=f"{MODEL_ID}:latest", messages=HELLO, think=False,
                              stream=True, options={"num_predict": 6}))
    assert "".join(c.message.content for c in chunks) == text
    assert [c.done for c in chunks] == [False] * (len(chunks) - 1) + [True]
    check_end(chunks[-1], prompt_tokens, 6, model=f"{MODEL_ID}:latest")
    kind, lines = ndjson(live, "/api/chat", {"model": MODEL_ID, "messages": HELLO,
                                             "think": False, "options": {"num_predict": 6}})
    assert kind == "application/x-ndjson"  # streamed by default, as Ollama does
    assert "".join(x["message"]["content"] for x in lines) == text


def test_generate_templated_raw_and_load(live, loaded, client):
    text, prompt_tokens = reference(loaded, [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "Hi"}], 5)
    reply = client.generate(model=MODEL_ID, prompt="Hi", system="Be brief.", think=False,
                            options={"num_predict": 5})
    assert reply.response == text and reply.thinking is None
    check_end(reply, prompt_tokens, 5)
    chunks = list(client.generate(model=MODEL_ID, prompt="Hi", system="Be brief.",
                                  think=False, stream=True, options={"num_predict": 5}))
    assert "".join(c.response for c in chunks) == text
    ids = loaded[1].encode_prompt("Once upon")
    raw = client.generate(model=MODEL_ID, prompt="Once upon", raw=True,
                          options={"num_predict": 5})
    assert raw.response == run(loaded, ids, 5)
    check_end(raw, len(ids), 5)
    for load in (client.generate(model=MODEL_ID, keep_alive="5m"),
                 client.chat(model=MODEL_ID, messages=[], keep_alive=0)):
        assert load.done and load.done_reason == "load" and load.eval_count is None


def test_think_on_and_off(live, client):
    live.hook.add("Think, please.", "Let me see.</think>It is 4.")
    ask = [{"role": "user", "content": "Think, please."}]
    reply = client.chat(model=MODEL_ID, messages=ask, think=True)
    assert (reply.message.thinking, reply.message.content) == ("Let me see.", "It is 4.")
    assert reply.done_reason == "stop"
    assert rendered(live).endswith(cf.USER + "Think, please." + cf.ASSISTANT + cf.THINK_START)
    chunks = list(client.generate(model=MODEL_ID, prompt="Think, please.", think="high",
                                  stream=True))
    assert "".join(c.thinking or "" for c in chunks) == "Let me see."
    assert "".join(c.response for c in chunks) == "It is 4."
    live.hook.add("No thinking.", "Plain.")
    reply = client.chat(model=MODEL_ID, messages=[{"role": "user", "content": "No thinking."}],
                        think=False)
    assert (reply.message.thinking, reply.message.content) == (None, "Plain.")
    assert rendered(live).endswith(cf.ASSISTANT + cf.THINK_END)


@pytest.mark.slow
def test_tool_calls_and_their_round_trip(live, client):
    """A call the model writes (forced; no tools sent, so the prompt stays short) comes back
    whole in `tool_calls`, streamed or not; sent back with its result, both are rendered."""
    live.hook.add("Call f.", "Sure." + CALL)
    ask = [{"role": "user", "content": "Call f."}]
    reply = client.chat(model=MODEL_ID, messages=ask, think=False)
    [tool_call] = reply.message.tool_calls
    assert (tool_call.function.name, tool_call.function.arguments) == ("f", {"a": 7})
    assert reply.message.content == "Sure." and reply.done_reason == "stop"
    chunks = list(client.chat(model=MODEL_ID, messages=ask, think=False, stream=True))
    calls = [call for c in chunks for call in c.message.tool_calls or ()]
    assert [(c.function.name, c.function.arguments) for c in calls] == [("f", {"a": 7})]
    live.hook.add("sunny", "Done.")
    answer = client.chat(model=MODEL_ID, think=False, messages=ask + [
        reply.message, {"role": "tool", "content": "sunny", "tool_name": "f"}])
    assert answer.message.content == "Done."
    assert rendered(live).endswith(cf.USER + "<tool_result>sunny</tool_result>" + cf.ASSISTANT
                                   + cf.THINK_END)
    assert f'{cf.INVOKE_OPEN} name="f">' in rendered(live)  # the call, sent back


@pytest.mark.slow
def test_tools_are_rendered_and_a_call_of_them_parsed(live, client):
    """`tools` reach the system message (the official tools block: an 872-token prompt)."""
    live.hook.add("Call f with tools.", CALL)
    reply = client.chat(model=MODEL_ID, messages=[{"role": "user",
                                                   "content": "Call f with tools."}],
                        tools=[TOOL], think=False)
    [tool_call] = reply.message.tool_calls
    assert (tool_call.function.name, tool_call.function.arguments) == ("f", {"a": 7})
    assert json.dumps(TOOL["function"]) in rendered(live)


def test_format_schema_and_json_validate_and_end(live, client):
    reply = client.chat(model=MODEL_ID, messages=HELLO, format=RECORD, think=False,
                        options={"num_predict": 200})
    jsonschema.validate(json.loads(reply.message.content), RECORD)
    assert reply.done_reason == "stop"
    chunks = list(client.chat(model=MODEL_ID, messages=HELLO, format=RECORD, stream=True,
                              think=False, options={"num_predict": 200}))
    assert "".join(c.message.content for c in chunks) == reply.message.content
    assert chunks[-1].done_reason == "stop"
    # forced text past the object: the grammar ends the reply where the object does
    live.hook.add("A JSON object?", '{"a": [1, 2]} and more')
    reply = client.generate(model=MODEL_ID, prompt="A JSON object?", format="json", think=False)
    assert reply.response == '{"a": [1, 2]}' and reply.done_reason == "stop"
    assert '"type": "json_object"' in rendered(live)  # the format, told in the system message


def test_options_num_predict_stop_seed_and_top_k(live, loaded, client):
    reply = client.chat(model=MODEL_ID, messages=HELLO, think=False,
                        options={"num_predict": 3})
    assert reply.eval_count == 3 and reply.done_reason == "length"
    live.hook.add("Stop early.", "abc STOP def")
    reply = client.chat(model=MODEL_ID, messages=[{"role": "user", "content": "Stop early."}],
                        think=False, options={"stop": ["STOP"]})
    assert reply.message.content == "abc " and reply.done_reason == "stop"

    def sampled(**options):
        return client.chat(model=MODEL_ID, messages=HELLO, think=False, options={
            "num_predict": 8, "temperature": 1.0, **options}).message.content

    first = sampled(seed=11)
    assert sampled(seed=11) == first and sampled(seed=12) != first
    greedy, _ = reference(loaded, HELLO, 8)
    assert sampled(seed=5, top_k=1, num_ctx=4096, repeat_penalty=1.1) == greedy  # ignored


def test_streams_keep_alive_and_end_with_an_error_line(live, client):
    live.hook.add("Slow.", "Fine.")
    config = live.app.state.config
    hook = live.app.state.logits_processors
    live.app.state.logits_processors = lambda request, prompt: hook(request, prompt) + [
        sleeping(0.4)]
    config.keepalive_seconds = 0.1
    try:
        chunks = list(client.chat(model=MODEL_ID, think=False, stream=True,
                                  messages=[{"role": "user", "content": "Slow."}]))
    finally:
        config.keepalive_seconds, live.app.state.logits_processors = 10.0, hook
    empty = [c for c in chunks[:-1] if not c.message.content]
    assert empty and "".join(c.message.content for c in chunks) == "Fine."
    live.hook.scripts["Fail."] = RuntimeError("boom")
    broken = [{"role": "user", "content": "Fail."}]
    with pytest.raises(ollama.ResponseError, match="boom"):
        list(client.chat(model=MODEL_ID, messages=broken, stream=True))
    status, _, body = call(live.port, "POST", "/api/chat", {"model": MODEL_ID, "stream": False,
                                                            "messages": broken})
    assert status == 500 and list(body) == ["error"] and "boom" in body["error"]


# ----------------------------------------------------------------------------- images

@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    return twin_images(tmp_path_factory.mktemp("images"))


def test_images_equal_stream_generate_and_bad_ones_are_named(loaded, client, twins):
    uri = "data:image/png;base64," + base64.b64encode(twins[0].read_bytes()).decode()
    blocks = [{"role": "user", "content": [{"type": "image", "image": uri},
                                           {"type": "text", "text": "What is this?"}]}]
    ids = loaded[1].apply_chat_template(blocks, enable_thinking=False)
    text = run(loaded, ids, 4, images=cf.collect_images(blocks))
    reply = client.chat(model=MODEL_ID, think=False, options={"num_predict": 4}, messages=[
        {"role": "user", "content": "What is this?", "images": [twins[0].read_bytes()]}])
    assert reply.message.content == text and reply.prompt_eval_count > len(ids)
    other = client.generate(model=MODEL_ID, prompt="What is this?", images=[twins[1]],
                            think=False, options={"num_predict": 4})
    assert other.response != text  # the reply depends on the pixels
    with pytest.raises(ollama.ResponseError) as error:
        client.chat(model=MODEL_ID, messages=[{"role": "user", "content": "?",
                                               "images": ["bm90IGFuIGltYWdl"]}])
    assert error.value.status_code == 400
    assert error.value.error.startswith("messages.0.images.0: not an image")


# ----------------------------------------------------------------------------- the model

def test_tags_show_ps_and_version(live, loaded, client):
    model, _ = loaded
    text = model.args.text_config
    [entry] = client.list().models
    assert entry.model == f"{MODEL_ID}:latest" and entry.size > 0
    details = entry.details
    assert (details.family, details.format, details.quantization_level) == (
        "deepseek_v41", "safetensors", "FP8/FP4")
    assert details.parameter_size == om.parameter_size(
        client.show(MODEL_ID).modelinfo["general.parameter_count"])
    shown = client.show(f"{MODEL_ID}:latest")
    assert shown.modelinfo["deepseek_v41.context_length"] == text.max_position_embeddings
    assert shown.modelinfo["deepseek_v41.block_count"] == text.num_hidden_layers == 2
    assert shown.capabilities == ["completion", "tools", "thinking", "vision"]
    assert "num_predict" in shown.parameters and shown.details == details
    [running] = client.ps().models
    assert running.context_length == text.max_position_embeddings
    assert running.size_vram == running.size > 0 and running.digest == entry.digest
    status, _, body = call(live.port, "GET", "/api/version")
    assert status == 200 and body == {"version": om.OLLAMA_VERSION}
    assert [om.parameter_size(n) for n in (999, 12_345, 284_000_000, 7_615_616_512)] == \
        ["999", "12.3K", "284.0M", "7.6B"]


# ----------------------------------------------------------------------------- errors

@pytest.mark.parametrize("path, body, status, words", [
    ("/api/chat", {"model": MODEL_ID, "messages": "hi"}, 400, "messages: Input should be"),
    ("/api/chat", {"model": MODEL_ID, "messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages.0.role:"),
    ("/api/chat", {"messages": HELLO}, 400, "model: Field required"),
    ("/api/chat", {"model": MODEL_ID, "messages": HELLO, "options": {"temperature": "hot"}},
     400, "options.temperature:"),
    ("/api/chat", {"model": MODEL_ID, "messages": HELLO, "format": {"type": "array",
                                                                      "items": 3}},
     400, "format:"),
    ("/api/chat", {"model": MODEL_ID, "messages": HELLO, "think": "very"}, 400, "think:"),
    ("/api/chat", {"model": "other", "messages": HELLO}, 404, "'other' does not exist"),
    ("/api/generate", {"model": MODEL_ID, "prompt": "x", "suffix": "y"}, 400, "suffix:"),
    ("/api/generate", {"model": MODEL_ID, "prompt": "x", "raw": True, "system": "s"}, 400,
     "system: not allowed with raw"),
    ("/api/generate", {"model": MODEL_ID, "prompt": "x", "images": ["AAAA"]}, 400,
     "images.0: not an image"),
    ("/api/generate", {"model": MODEL_ID, "prompt": "x", "images": ["http://a/b.png"]}, 400,
     "images.0: image URLs are not fetched"),
    ("/api/show", {}, 400, "model: Field required"),
    ("/api/show", {"model": "other"}, 404, "'other' does not exist"),
    ("/api/pull", {"model": MODEL_ID}, 404, "Not Found"),
])
def test_bad_input_is_an_ollama_error(live, path, body, status, words):
    got, headers, answer = call(live.port, "POST", path, body)
    assert got == status and list(answer) == ["error"], answer
    assert words in answer["error"] and "\n" not in answer["error"]
    assert headers["content-type"] == "application/json"


def test_errors_through_the_client(client):
    with pytest.raises(ollama.ResponseError) as error:
        client.chat(model="other", messages=HELLO)
    assert error.value.status_code == 404 and "'other' does not exist" in error.value.error
    with pytest.raises(ollama.ResponseError) as error:
        list(client.chat(model=MODEL_ID, messages=HELLO, stream=True, options={"top_p": 2}))
    assert error.value.status_code == 400 and error.value.error.startswith("options.top_p:")


def test_api_keys_and_metrics(loaded, monkeypatch):
    server = LiveServer(*loaded, api_keys=[KEY])
    host = f"http://127.0.0.1:{server.port}"
    try:
        monkeypatch.setenv("OLLAMA_API_KEY", KEY)  # how the client sends a key
        assert ollama.Client(host=host).list().models[0].model == f"{MODEL_ID}:latest"
        monkeypatch.delenv("OLLAMA_API_KEY")
        for client in (ollama.Client(host=host),
                       ollama.Client(host=host, headers={"Authorization": "Bearer wrong"})):
            with pytest.raises(ollama.ResponseError) as error:
                client.chat(model=MODEL_ID, messages=HELLO)
            assert error.value.status_code == 401
        status, headers, body = call(server.port, "POST", "/api/chat", {"model": MODEL_ID})
        assert status == 401 and list(body) == ["error"]
        assert headers["www-authenticate"] == "Bearer"
        status, _, text = call(server.port, "GET", "/metrics",
                               headers={"Authorization": f"Bearer {KEY}"})
        assert 'route="/api/tags",status="200"' in text
        assert 'route="/api/chat",status="401"' in text
    finally:
        server.close()


def test_the_openapi_schema_declares_the_routes(live):
    _, _, spec = call(live.port, "GET", "/openapi.json")
    paths = spec["paths"]
    assert {"/api/chat", "/api/generate", "/api/show"} <= set(paths)
    assert {"/api/tags", "/api/ps", "/api/version"} <= set(paths)
    ok = paths["/api/chat"]["post"]["responses"]["200"]["content"]
    assert set(ok) == {"application/json", "application/x-ndjson"}
    body = paths["/api/generate"]["post"]["requestBody"]["content"]["application/json"]
    assert {"prompt", "images", "options", "think", "format"} <= set(body["schema"][
        "properties"])
