"""Running `mlx_v41.server` for a team: API keys on every route but /health in each API's error
shape (the real `openai` and `anthropic` clients, raw HTTP), keys from flags, a file and the
environment, CORS only when asked, the warning for a public host without a key; 503
{"status": "loading"} while the model loads; the drain (in process, and SIGTERM/SIGINT on the
CLI): replies under way finish or end with their API's error event, new requests get 503,
the prompt caches are written, exit status 0; `--help` without transformers' PyTorch line."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import anthropic
import openai
import pytest

from conftest import golden_checkpoint
from mlx_v41.cli import server as cli
from mlx_v41.server.auth import KEY_ENV, read_keys
from server_harness import (MODEL_ID, CliServer, Forcing, LiveServer, call, sse_data,
                            sse_lines, tiny)

pytestmark = pytest.mark.usefixtures("cpu")

KEYS = ("sk-team-one", "sk-team-two")
ORIGIN = "https://app.example.com"
CHAT_OFF = {"chat_template_kwargs": {"thinking": False}}
EOS = 1  # the tiny tokenizer's


def is_openai_error(body, code: str) -> bool:
    return isinstance(body, dict) and set(body) == {"error"} and body["error"]["code"] == code


def is_anthropic_error(body, kind: str) -> bool:
    return isinstance(body, dict) and body.get("type") == "error" and \
        body["error"]["type"] == kind


class Slow(Forcing):
    """Forcing, and every token takes at least `seconds` (so a reply is still running when a
    test acts)."""

    def __init__(self, tokenizer, seconds: float):
        super().__init__(tokenizer)
        self.seconds = seconds

    def __call__(self, request, prompt):
        return super().__call__(request, prompt) + [self.pause]

    def pause(self, history, logits):
        time.sleep(self.seconds)
        return logits


# ----------------------------------------------------------------------------- keys

@pytest.fixture(scope="module")
def keyed():
    server = LiveServer(*tiny(), api_keys=KEYS)
    yield server
    server.close()


ROUTES = [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
          ("POST", "/v1/responses"), ("GET", "/v1/responses/resp_1"),
          ("DELETE", "/v1/responses/resp_1"), ("POST", "/v1/messages"),
          ("POST", "/v1/messages/count_tokens"), ("GET", "/metrics"), ("GET", "/openapi.json"),
          ("GET", "/docs"), ("GET", "/no/such/route")]


@pytest.mark.parametrize("method, path", ROUTES)
def test_every_route_but_health_needs_a_key_in_its_api_shape(keyed, method, path):
    body = {} if method == "POST" else None
    anthropic_shape = path.startswith("/v1/messages")
    for headers, words in (({}, "no API key"),
                           ({"Authorization": "Bearer sk-wrong"}, "not valid"),
                           ({"x-api-key": "sk-team-one-and-more"}, "not valid"),
                           ({"Authorization": f"Basic {KEYS[0]}"}, "no API key")):
        status, head, reply = call(keyed.port, method, path, body, headers)
        assert status == 401 and head["www-authenticate"] == "Bearer", (headers, reply)
        if anthropic_shape:
            assert is_anthropic_error(reply, "authentication_error"), reply
            assert words in reply["error"]["message"]
        else:
            assert is_openai_error(reply, "invalid_api_key"), reply
            assert reply["error"]["type"] == "invalid_request_error"
            assert words in reply["error"]["message"] and KEYS[0] not in json.dumps(reply)
    for headers in ({"Authorization": f"Bearer {KEYS[1]}"}, {"x-api-key": KEYS[0]},
                    {"authorization": f"bearer {KEYS[0]}"}):
        status, _, reply = call(keyed.port, method, path, body, headers)
        assert status != 401, (headers, reply)


def test_health_needs_no_key(keyed):
    status, _, reply = call(keyed.port, "GET", "/health")
    assert (status, reply) == (200, {"status": "ok", "model": MODEL_ID})


def test_keys_with_the_openai_client(keyed):
    with pytest.raises(openai.AuthenticationError, match="not valid"):
        keyed.client(api_key="sk-wrong").models.list()
    with pytest.raises(openai.AuthenticationError):
        list(keyed.client(api_key="sk-wrong").chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            stream=True))
    client = keyed.client(api_key=KEYS[1])
    assert [m.id for m in client.models.list()] == [MODEL_ID]
    stream = client.chat.completions.create(model=MODEL_ID, max_tokens=2, stream=True,
                                            messages=[{"role": "user", "content": "hi"}],
                                            extra_body=CHAT_OFF)
    assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == "length"
    assert client.responses.create(model=MODEL_ID, input="hi", max_output_tokens=2).id


def test_keys_with_the_anthropic_client(keyed):
    def client(**auth):
        return anthropic.Anthropic(base_url=f"http://127.0.0.1:{keyed.port}", max_retries=0,
                                   **auth)

    message = {"model": MODEL_ID, "max_tokens": 2, "messages": [{"role": "user",
                                                                  "content": "hi"}]}
    with pytest.raises(anthropic.AuthenticationError, match="not valid"):
        client(api_key="sk-wrong").messages.create(**message)
    with pytest.raises(anthropic.AuthenticationError):
        with client(api_key="sk-wrong").messages.stream(**message) as stream:
            list(stream)
    assert client(api_key=KEYS[0]).messages.create(**message).usage.output_tokens == 2
    assert client(auth_token=KEYS[1]).messages.count_tokens(
        model=MODEL_ID, messages=message["messages"]).input_tokens > 0
    with client(api_key=KEYS[1]).messages.stream(**message) as stream:
        assert stream.get_final_message().stop_reason == "max_tokens"


def test_cors_preflight_only_with_allowed_origins(keyed):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    status, head, _ = call(keyed.port, "OPTIONS", "/v1/chat/completions", None, preflight)
    assert status == 401 and "access-control-allow-origin" not in head  # CORS is off
    server = LiveServer(*tiny(), api_keys=KEYS, allowed_origins=[ORIGIN])
    try:
        status, head, _ = call(server.port, "OPTIONS", "/v1/chat/completions", None, preflight)
        assert status == 200 and head["access-control-allow-origin"] == ORIGIN
        assert "authorization" in head["access-control-allow-headers"].lower()
        status, _, _ = call(server.port, "OPTIONS", "/v1/chat/completions", None,
                            {**preflight, "Origin": "https://elsewhere.example"})
        assert status == 400
        status, head, _ = call(server.port, "GET", "/v1/models", None, {"Origin": ORIGIN})
        assert status == 401 and head["access-control-allow-origin"] == ORIGIN  # readable
        status, head, _ = call(server.port, "GET", "/v1/models", None,
                               {"Origin": ORIGIN, "Authorization": f"Bearer {KEYS[0]}"})
        assert status == 200 and head["access-control-allow-origin"] == ORIGIN
    finally:
        server.close()


def test_keys_from_flags_file_and_environment(tmp_path):
    file = tmp_path / "keys"
    file.write_text("# the team's keys\nsk-file-one\n\n  sk-file-two  \n")
    assert read_keys(["sk-flag", "sk-file-one"], str(file), {KEY_ENV: "sk-env, sk-flag"}) == \
        ["sk-flag", "sk-file-one", "sk-file-two", "sk-env"]
    assert read_keys([], None, {}) == []
    empty = tmp_path / "empty"
    empty.write_text("\n# nothing here\n")
    for args, words in (((["",], None, {}), "--api-key: an empty API key"),
                        (([], str(empty), {}), "holds no key"),
                        (([], str(tmp_path / "none"), {}), "cannot read"),
                        (([], None, {KEY_ENV: ""}), f"{KEY_ENV}: an empty API key"),
                        (([], None, {KEY_ENV: "a,,b"}), "an empty API key"),
                        ((["sk é"], None, {}), "printable ASCII")):
        with pytest.raises(ValueError, match=re.escape(words)):
            read_keys(*args)


@pytest.mark.parametrize("flags, env, words", [
    (["--api-key", " "], {}, "--api-key: an empty API key"),
    (["--api-key-file", "EMPTY"], {}, "holds no key"),
    ([], {KEY_ENV: ""}, f"{KEY_ENV}: an empty API key")])
def test_an_empty_key_is_refused_at_startup_in_one_line(tmp_path, capsys, monkeypatch, flags,
                                                         env, words):
    (tmp_path / "empty").write_text("")
    flags = [str(tmp_path / "empty") if f == "EMPTY" else f for f in flags]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--model", str(tmp_path / "none"), *flags])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and words in err, err


def test_a_public_host_without_a_key_is_warned_in_one_line(tmp_path, capsys, monkeypatch):
    """Checked before anything listens (the model folder does not exist: one more line)."""
    monkeypatch.delenv(KEY_ENV, raising=False)
    assert cli.main(["--model", str(tmp_path / "none"), "--host", "0.0.0.0"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith("mlx_v41.server: warning: --host 0.0.0.0 ")
    assert "without an API key" in err[0] and "model folder not found" in err[1]
    for flags in (["--host", "0.0.0.0", "--api-key", "sk-x"], ["--host", "127.0.0.1"],
                  ["--host", "::1"], ["--host", "localhost"]):
        assert cli.main(["--model", str(tmp_path / "none"), *flags]) == 1
        assert "warning" not in capsys.readouterr().err
    assert cli.is_loopback("127.0.0.2") and not cli.is_loopback("example.com")
    monkeypatch.setenv("MLX_RANK", "1")  # mlx.launch's other ranks: rank 0 alone warns
    assert cli.main(["--model", str(tmp_path / "none"), "--host", "0.0.0.0"]) == 1
    assert "warning" not in capsys.readouterr().err


# ----------------------------------------------------------------------------- loading

def test_health_says_loading_until_the_model_is_in():
    server = LiveServer(*tiny(), api_keys=KEYS, loading=True)
    key = {"Authorization": f"Bearer {KEYS[0]}"}
    try:
        assert call(server.port, "GET", "/health")[::2] == (503, {"status": "loading"})
        status, _, reply = call(server.port, "POST", "/v1/chat/completions", {}, key)
        assert status == 503 and is_openai_error(reply, "model_loading")
        status, _, reply = call(server.port, "POST", "/v1/messages", {}, key)
        assert status == 503 and is_anthropic_error(reply, "overloaded_error")
        assert call(server.port, "GET", "/v1/models")[0] == 401  # the key check comes first
        with pytest.raises(openai.InternalServerError, match="loading"):
            server.client(api_key=KEYS[0]).models.list()
        server.finish_loading()
        assert call(server.port, "GET", "/health")[::2] == \
            (200, {"status": "ok", "model": MODEL_ID})
        reply = server.client(api_key=KEYS[0]).completions.create(model=MODEL_ID,
                                                                  prompt="hi", max_tokens=2)
        assert reply.usage.completion_tokens == 2
    finally:
        server.close()


# ----------------------------------------------------------------------------- drain

def eventually(predicate, seconds: float = 30) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def replying(live, count: int, seconds: float = 60) -> None:
    """Wait until `count` requests are in flight, each with a token out."""
    deadline = time.monotonic() + seconds
    while not (live.engine.in_flight == count and
               all(job.has_reply for job in list(live.engine._jobs))):
        assert time.monotonic() < deadline, "the replies did not start"
        time.sleep(0.01)


@pytest.mark.parametrize("serial", [False, True])
@pytest.mark.slow
def test_a_drain_lets_a_reply_finish_and_refuses_new_requests(tmp_path, serial):
    model, tokenizer = tiny()
    folder = tmp_path / "prompts"
    live = LiveServer(model, tokenizer, folder=folder, hook=Slow(tokenizer, 0.2),
                      serial=serial)
    script = live.hook.add("story", "one two three four five six seven eight nine ten")
    lines, started = [], threading.Event()
    body = {"messages": [{"role": "user", "content": "Tell me"}], "stream": True,
            "max_tokens": 100, "user": "story", **CHAT_OFF}
    reader = threading.Thread(target=sse_lines, args=(live.port, "/v1/chat/completions",
                                                      body, lines, started))
    try:
        reader.start()
        replying(live, 1)
        drained = live.drain(60)
        time.sleep(0.1)
        status, _, reply = call(live.port, "POST", "/v1/chat/completions", body)
        assert status == 503 and is_openai_error(reply, "shutting_down"), reply
        status, _, reply = call(live.port, "POST", "/v1/messages", {})
        assert status == 503 and is_anthropic_error(reply, "overloaded_error"), reply
        assert call(live.port, "GET", "/health")[::2] == (503, {"status": "draining"})
        assert live.engine.in_flight == 1  # the reply is still being written
        reader.join(60)
        drained.result(60)
        live.thread.join(60)  # the drain stopped the server
        assert not live.thread.is_alive()
    finally:
        live.close()
    assert lines[0] == 200 and lines[-1] == "data: [DONE]"
    chunks = sse_data(lines)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == tokenizer.decode(script[:-1])
    assert list(folder.glob("*.safetensors"))  # the prompt caches were written


@pytest.mark.slow
def test_past_the_grace_replies_end_with_their_api_error(tmp_path, caplog):
    model, tokenizer = tiny()
    live = LiveServer(model, tokenizer, hook=Slow(tokenizer, 0.05),
                      batching={"prefill_step_size": 16})
    live.hook.add("long", "a" * 400, eos=False)
    chat = {"messages": [{"role": "user", "content": "Go"}], "max_tokens": 400,
            "user": "long", **CHAT_OFF}
    streams = {"openai": ("/v1/chat/completions", {**chat, "stream": True}),
               "anthropic": ("/v1/messages", {"messages": chat["messages"], "max_tokens": 400,
                                              "metadata": {"user_id": "long"},
                                              "stream": True}),
               "responses": ("/v1/responses", {"input": "Go", "max_output_tokens": 400,
                                               "user": "long", "stream": True})}
    lines = {name: [] for name in streams}
    threads = [threading.Thread(target=sse_lines, args=(live.port, path, body, lines[name],
                                                        threading.Event()))
               for name, (path, body) in streams.items()]
    plain = []
    threads.append(threading.Thread(target=lambda: plain.append(
        call(live.port, "POST", "/v1/chat/completions", chat))))
    threads.append(threading.Thread(target=lambda: plain.append(
        call(live.port, "POST", "/v1/responses", {"input": "Go", "max_output_tokens": 400,
                                                  "user": "long"}))))
    try:
        for t in threads:
            t.start()
        replying(live, 5)
        # one more, still reading its 3,000-word prompt: ended at once
        prompt = {"prompt": " ".join(["tree"] * 3000), "max_tokens": 2}
        threads.append(threading.Thread(target=lambda: plain.append(
            call(live.port, "POST", "/v1/completions", prompt))))
        threads[-1].start()
        assert eventually(lambda: any(len(run.todo) > 1000
                                      for run in list(live.engine.running.values())))
        steps = live.engine.steps
        assert eventually(lambda: live.engine.steps >= steps + 2)  # a few of its chunks are in
        tic = time.monotonic()
        with caplog.at_level("INFO", logger="mlx_v41.server"):
            live.drain(0.5).result(30)
        assert time.monotonic() - tic < 5
        for t in threads:
            t.join(30)
    finally:
        live.close()
    for status, _, reply in plain:
        assert status == 503 and is_openai_error(reply, "shutting_down"), reply
    assert "shut down before the reply finished" in json.dumps(plain)
    assert "was not started" in json.dumps(plain)
    assert re.search(r"cancelled after \d+ of \d+ prefilled", caplog.text)
    openai_events = sse_data(lines["openai"])
    assert "error" in openai_events[-1] and "shut down" in openai_events[-1]["error"]["message"]
    assert openai_events[-1]["error"]["code"] == "shutting_down"
    assert lines["openai"][-1] == "data: [DONE]"  # the stream ends as a client's reader expects
    assert lines["anthropic"][-2] == "event: error"
    error = json.loads(lines["anthropic"][-1][6:])["error"]
    assert error["message"].count("shut down") and error["type"] == "overloaded_error"
    assert "internal error" not in json.dumps(openai_events[-1]) + json.dumps(error)
    assert sse_data(lines["responses"])[-1]["type"] == "response.failed"


def test_a_prompt_cache_dir_replaced_by_a_file_is_one_line(tmp_path, caplog):
    model, tokenizer = tiny()
    folder = tmp_path / "prompts"
    live = LiveServer(model, tokenizer, folder=folder)
    try:
        client = live.client()
        client.completions.create(model=MODEL_ID, prompt="first prompt", max_tokens=2)
        assert eventually(lambda: list(folder.glob("*.safetensors")))  # written after the reply
        for path in folder.iterdir():
            path.unlink()
        folder.rmdir()
        folder.write_text("not a folder")
        with caplog.at_level("WARNING", logger="mlx_v41.server"):
            client.completions.create(model=MODEL_ID, prompt="another prompt", max_tokens=2)
            assert eventually(lambda: "not persisted" in caplog.text)
        reply = client.completions.create(model=MODEL_ID, prompt="still here", max_tokens=2)
        assert reply.usage.completion_tokens == 2
    finally:
        live.close()
    records = [r for r in caplog.records if r.name == "mlx_v41.server"]
    assert records and all(r.exc_info is None for r in records)
    assert "prompt caches not persisted: cannot make the folder" in caplog.text
    assert "\n" not in records[0].getMessage()


# ----------------------------------------------------------------------------- the CLI

@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_when_idle_exits_0(sig):
    server = CliServer()
    try:
        server.ready()
        status, seconds = server.stop(sig)
    finally:
        server.kill()
    assert status == 0 and seconds < 5, server.err
    assert "mlx_v41.server: shut down" in server.err and "Traceback" not in server.err


@pytest.mark.slow
def test_sigterm_drains_a_streaming_reply_and_writes_the_prompt_caches(tmp_path):
    folder = tmp_path / "prompts"
    server = CliServer("--prompt-cache-dir", str(folder), "--drain-seconds", "120")
    lines, started = [], threading.Event()
    body = {"prompt": "Once upon a time", "max_tokens": 300, "stream": True,
            "logit_bias": {str(EOS): -100}}  # no early end: all 300 tokens
    try:
        server.ready()
        reader = threading.Thread(target=sse_lines,
                                  args=(server.port, "/v1/completions", body, lines, started))
        reader.start()
        assert started.wait(60)
        server.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while call(server.port, "GET", "/health")[0] != 503:
            assert time.monotonic() < deadline, server.err
            time.sleep(0.05)
        status, _, reply = call(server.port, "POST", "/v1/completions",
                                {"prompt": "hi", "max_tokens": 2})
        assert status == 503 and is_openai_error(reply, "shutting_down"), reply
        assert reader.is_alive()  # the reply is still being written
        assert server.process.wait(timeout=120) == 0, server.err
        reader.join(30)
    finally:
        server.kill()
    chunks = sse_data(lines)
    assert lines[-1] == "data: [DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(bool(c["choices"][0]["text"]) for c in chunks) > 250, chunks[-1]
    assert list(folder.glob("*.safetensors")), server.err
    assert "Traceback" not in server.err and "mlx_v41.server: shut down" in server.err


@pytest.mark.slow
def test_past_the_drain_seconds_and_mid_prompt_the_cli_ends_replies_with_an_error():
    """SIGTERM with a reply decoding and one still reading a long prompt: the prompt stops at
    its next chunk, the reply at --drain-seconds, each stream's last event is an error, no
    traceback is logged, the process exits 0 within 5 s."""
    server = CliServer("--drain-seconds", "1", "--prefill-step-size", "16")
    decoding, reading = [], []
    flags = [threading.Event(), threading.Event()]
    bodies = [{"prompt": "Once upon a time", "max_tokens": 5000, "stream": True,
               "logit_bias": {str(EOS): -100}},
              {"prompt": " ".join(["tree"] * 6000), "max_tokens": 2, "stream": True}]
    try:
        server.ready()
        threads = [threading.Thread(target=sse_lines, args=(server.port, "/v1/completions",
                                                            body, into, flag))
                   for body, into, flag in zip(bodies, (decoding, reading), flags)]
        for t in threads:
            t.start()
        assert flags[0].wait(60)
        time.sleep(2.0)  # the long prompt is being read (it would take minutes)
        status, seconds = server.stop(signal.SIGTERM)
        for t in threads:
            t.join(30)
    finally:
        server.kill()
    assert status == 0 and seconds < 5, (seconds, server.err)
    for lines in (decoding, reading):
        assert "error" in sse_data(lines)[-1], lines[-3:]
    assert re.search(r"cancelled after \d+ of \d+ prefilled", server.err), server.err
    assert "Traceback" not in server.err and "CancelledError" not in server.err


@pytest.mark.slow
def test_help_has_no_transformers_line():
    done = subprocess.run([sys.executable, "-m", "mlx_v41.server", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--api-key" in done.stdout
    assert "PyTorch" not in done.stdout + done.stderr, done.stderr


def test_host_port_in_use_is_one_line(capsys):
    """The address is taken: uvicorn's own line, then ours; nothing was loaded."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["--model", str(golden_checkpoint("tiny")), "--port", str(port),
                         "--log-level", "ERROR"]) == 1
    err = capsys.readouterr().err
    assert f"mlx_v41.server: error: cannot listen on 127.0.0.1:{port}" in err
