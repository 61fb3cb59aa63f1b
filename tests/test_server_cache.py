"""`mlx_v41.server`'s prompt caches: a second turn prefills only its new tokens (chat mode from
the reply, thinking mode from the prompt snapshot), also after restarting the CLI server with
--prompt-cache-dir (then Ctrl-C shuts it down cleanly); files of another checkpoint refused,
damaged files skipped; the context limit; DSpark serving equal to plain greedy. Tiny golden
checkpoint."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import mlx_v41
from mlx_v41.chat import format as cf
from mlx_v41.generation.api import prefill
from mlx_v41.generation.prompt_reuse import PromptCache
from mlx_v41.server.engine.prompt_store import PromptCacheStore
from conftest import golden_checkpoint, with_context, writable_copy
from server_harness import MODEL_ID, Forcing, LiveServer, forcing_server, get, post, tiny

pytestmark = pytest.mark.usefixtures("cpu")

REPO = Path(__file__).resolve().parents[1]
CHAT_OFF = {"chat_template_kwargs": {"thinking": False}}
THINKING = {"chat_template_kwargs": {"thinking": True}}
SHORT_CONTEXT = 64


@pytest.fixture(scope="module")
def live():
    yield from forcing_server(*tiny())


def new_turn_tokens(text: str, header: str) -> list:
    _, tokenizer = tiny()
    return tokenizer.encode(f"{cf.USER}{text}{cf.ASSISTANT}{header}", add_special_tokens=False)


def two_turns(server, first_reply: str, extra: dict, user: str):
    """Turn 1 (its reply forced), then turn 2 with that reply in the history."""
    server.hook.add(user, first_reply)
    client = server.client()
    history = [{"role": "user", "content": f"Hello from {user}"}]
    first = client.chat.completions.create(model=MODEL_ID, messages=history, max_tokens=80,
                                           user=user, extra_body=extra)
    message = first.choices[0].message
    history += [{"role": "assistant", "content": message.content}]
    second = client.chat.completions.create(
        model=MODEL_ID, messages=history + [{"role": "user", "content": "And then?"}],
        max_tokens=2, extra_body=extra)
    return first, second


def test_second_turn_prefills_only_the_new_tokens(live):
    first, second = two_turns(live, "Sure, here it is.", CHAT_OFF, "chat")
    assert first.choices[0].message.content == "Sure, here it is."
    assert first.usage.prompt_tokens_details.cached_tokens <= 1  # at most the shared BOS
    reply_tokens = len(live.hook.scripts["chat"])  # with its EOS
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == first.usage.prompt_tokens + reply_tokens
    assert second.usage.prompt_tokens - cached == len(new_turn_tokens("And then?", cf.THINK_END))


@pytest.mark.slow
def test_thinking_turn_resumes_from_the_prompt_snapshot(live):
    """Thinking mode drops turn 1's reasoning and closes its header with `</think>`: the cache
    of the prompt (up to `<think>`) serves; the reply's own is too far off to roll back."""
    reasoning = "Let me think it over."  # the reply: more tokens than the rollback (17)
    first, second = two_turns(live, reasoning + cf.THINK_END + "Fine.", THINKING, "think")
    assert first.choices[0].message.content == "Fine."
    assert first.choices[0].message.reasoning_content == reasoning
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1


def test_failed_validation_and_context_limit(short):
    server, model, tokenizer = short
    status, body = post(server.port, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "word " * SHORT_CONTEXT}]})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert f"context is {SHORT_CONTEXT} tokens" in body["error"]["message"]
    status, body = post(server.port, "/v1/completions", {"prompt": "ok", "max_tokens": 1})
    assert status == 200 and body["usage"]["completion_tokens"] == 1


def test_dspark_serving_equals_plain_greedy(short):
    server, model, tokenizer = short
    messages = [{"role": "user", "content": "Hi"}]
    ids = tokenizer.apply_chat_template(messages, enable_thinking=False)
    plain = list(mlx_v41.stream_generate(model, tokenizer, ids, max_tokens=12))
    reply = server.client().chat.completions.create(model=MODEL_ID, messages=messages,
                                                    max_tokens=12, extra_body=CHAT_OFF)
    assert server.engine.draft["draft"] == "dspark"
    assert reply.choices[0].message.content == "".join(r.text for r in plain)
    assert reply.usage.completion_tokens == len(plain)
    assert reply.choices[0].finish_reason == plain[-1].finish_reason


@pytest.fixture(scope="module")
def short(tmp_path_factory):
    """Another checkpoint: the tiny golden with a 64-position context, with its drafter,
    served with DSpark."""
    folder = with_context(writable_copy(golden_checkpoint("tiny"),
                                        tmp_path_factory.mktemp("short") / "hf"), SHORT_CONTEXT)
    model, tokenizer = mlx_v41.load(folder, dspark=True)
    server = LiveServer(model, tokenizer, draft="dspark")
    yield server, model, tokenizer
    server.close()


# ----------------------------------------------------------------------------- persistence

def start_cli(folder: Path) -> tuple:
    """`python -m mlx_v41.server` on a free port, its model loaded; (process, port, lines)."""
    command = [sys.executable, "-m", "mlx_v41.server", "--model", str(golden_checkpoint("tiny")),
               "--port", "0", "--prompt-cache-dir", str(folder), "--no-thinking", "-m", "2"]
    process = subprocess.Popen(command, cwd=REPO, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines, deadline = [], time.monotonic() + 90
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        lines.append(line)
        match = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", line)
        if match:  # it listens at once, and loads the model after: /health says when
            while get(int(match.group(1)), "/health")[0] != 200 and \
                    time.monotonic() < deadline and process.poll() is None:
                time.sleep(0.1)
            return process, int(match.group(1)), lines
        if not line and process.poll() is not None:
            break
    process.kill()
    raise AssertionError("the server did not start:\n" + "".join(lines))


@pytest.mark.slow
def test_restart_with_prompt_cache_dir_then_ctrl_c(tmp_path):
    model, tokenizer = tiny()
    folder = tmp_path / "prompts"
    server = LiveServer(model, tokenizer, folder=folder, hook=Forcing(tokenizer))
    server.hook.add("restart", "Noted.")
    history = [{"role": "user", "content": "Remember me"}]
    first = server.client().chat.completions.create(model=MODEL_ID, messages=history,
                                                    max_tokens=20, user="restart",
                                                    extra_body=CHAT_OFF)
    server.close()  # writes what is new
    files = sorted(folder.glob("*.safetensors"))
    assert files and not list(folder.glob(".*"))

    process, port, lines = start_cli(folder)
    try:
        history += [{"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "Back again"}]
        status, second = post(port, "/v1/chat/completions", {"messages": history})
        assert status == 200, second
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == first.usage.prompt_tokens + len(server.hook.scripts["restart"])
        assert second["usage"]["prompt_tokens"] - cached == \
            len(new_turn_tokens("Back again", cf.THINK_END))
    finally:
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
    assert process.returncode == 0, "".join(lines) + err
    assert "mlx_v41.server: shut down" in err and "Traceback" not in err


def prefilled(model, tokenizer, text: str) -> PromptCache:
    ids = tokenizer.encode_prompt(text)
    state = PromptCache(model.make_cache(), list(ids))
    prefill(model, ids, state.cache)
    return state


def test_cache_files_of_another_checkpoint_are_refused(tmp_path, short, caplog):
    model, tokenizer = tiny()
    folder = tmp_path / "prompts"
    store = PromptCacheStore(model, 1 << 30, folder)
    store.insert(prefilled(model, tokenizer, "a cached prompt"))
    store.flush()
    [written] = folder.glob("*.safetensors")
    other = PromptCacheStore(short[1], 1 << 30, folder)
    with caplog.at_level(logging.WARNING, logger="mlx_v41.server"):
        assert other.load_folder() == 0
    assert "refused" in caplog.text and written.name in caplog.text
    assert "another config" in caplog.text
    assert written.exists()  # not ours to delete
    assert PromptCacheStore(model, 1 << 30, folder).load_folder() == 1


def test_a_damaged_cache_file_is_skipped_and_logged(tmp_path, caplog):
    model, tokenizer = tiny()
    folder = tmp_path / "prompts"
    store = PromptCacheStore(model, 1 << 30, folder)
    store.insert(prefilled(model, tokenizer, "a cached prompt"))
    store.insert(prefilled(model, tokenizer, "another prompt entirely"))
    store.flush()
    damaged, kept = sorted(folder.glob("*.safetensors"))
    raw = bytearray(damaged.read_bytes())
    data = 8 + int.from_bytes(raw[:8], "little")  # the tensors follow the JSON header
    raw[(data + len(raw)) // 2] ^= 0xFF
    damaged.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="mlx_v41.server"):
        assert PromptCacheStore(model, 1 << 30, folder).load_folder() == 1
    assert f"prompt cache refused: {damaged}: the file is damaged" in caplog.text
