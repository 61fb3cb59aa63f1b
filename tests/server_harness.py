"""A live `mlx_v41.server` for tests: uvicorn on 127.0.0.1 on a free port in a background
thread, the real `openai` client, raw HTTP (SSE lines too), a logits processor that forces a
reply, and the CLI as a process (`CliServer`)."""

from __future__ import annotations

import functools
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import asyncio

import mlx.core as mx
import openai
import uvicorn

import mlx_v41
from mlx_v41.chat import format as cf
from mlx_v41.server import Engine, PromptCacheStore, ServerConfig, create_app
from mlx_v41.server.app import create_loading_app
from mlx_v41.server.lifecycle import Swap
from mlx_v41.server.engine.batch import BatchEngine
from checkpoint_factory import tiny_text_config, write_checkpoint
from conftest import golden_checkpoint

MODEL_ID = "tiny"
STARTUP_SECONDS = 30


@functools.lru_cache(maxsize=None)
def tiny():
    """The tiny golden model and tokenizer, loaded once for all server test modules, as
    `mlx_v41.server` loads it without --dspark (the backbone alone)."""
    return mlx_v41.load(golden_checkpoint("tiny"), dspark=False)


def write_swa_checkpoint(folder: Path, **overrides) -> Path:
    """A random checkpoint with the cheapest decode: 2 sliding-window-only layers, no Engram
    (the tiny golden's tokenizer). For tests whose subject is the serving, not the model:
    long forced replies, the load test."""
    config = tiny_text_config(num_hidden_layers=2, compress_ratios=[0] * 5,
                              candidate_source_layer_id=-1, dspark_target_layer_ids=[0, 1, 1],
                              index_source_layer_ids=[], kv_source_layer_ids=[], **overrides)
    return write_checkpoint(folder, config, engram=False)


class Forcing:
    """The test hook: a request whose `user` names a script gets a processor that makes the
    real model write exactly those tokens (then EOS). Records every prompt it sees."""

    def __init__(self, tokenizer):
        self.tokenizer, self.scripts, self.prompts = tokenizer, {}, []
        self.eos = tokenizer.convert_tokens_to_ids(cf.EOS)

    def add(self, name: str, text: str, eos: bool = True) -> list:
        tokens = self.tokenizer.encode(text, add_special_tokens=False) + ([self.eos] if eos else [])
        self.scripts[name] = tokens
        return tokens

    def __call__(self, request, prompt):
        self.prompts.append(list(prompt))
        script = self.scripts.get(request.user)
        if isinstance(script, Exception):
            return [_raising(script)]
        return [] if script is None else [forcing(script, len(prompt), self.eos)]


FORCE = 1e4  # a logit bias no model logit comes near: the scripted token wins unless banned


def forcing(script: list, prompt_length: int, eos: int):
    """A logits processor that makes the next scripted token win (a token another processor
    banned stays impossible: the bias is added)."""
    def processor(history, logits):
        n = history.shape[0] - prompt_length
        target = script[n] if n < len(script) else eos
        return logits + mx.where(mx.arange(logits.shape[-1]) == target, FORCE, 0.0)
    return processor


def _raising(error: Exception):
    def processor(history, logits):
        raise error
    return processor


class LiveServer:
    """`create_app` served by uvicorn in a thread; `close()` shuts it down like Ctrl-C,
    `drain()` as `mlx_v41.server`'s SIGTERM does. The engine batches (`BatchEngine`, with
    `batching` options) as `mlx_v41.server` does, unless `serial` or a `draft` asks for the
    one-at-a-time `Engine`. `api_keys` and `allowed_origins` go to `create_app`; with
    `loading`, the server listens with the loading app until `finish_loading()` (as
    `mlx_v41.server` does while the model loads)."""

    def __init__(self, model, tokenizer, *, folder=None, cache_bytes=1 << 30,
                 max_concurrent=8, draft=None, hook=None, serial=False, batching=None,
                 api_keys=(), allowed_origins=(), loading=False, **config):
        self.hook = hook
        self.store = PromptCacheStore(model, cache_bytes, folder)
        if serial or draft:
            self.engine = Engine(model, tokenizer, self.store, max_concurrent=max_concurrent,
                                 draft=draft)
        else:
            self.engine = BatchEngine(model, tokenizer, self.store,
                                      max_concurrent=max_concurrent, **(batching or {}))
        self.app = create_app(self.engine, ServerConfig(model_id=MODEL_ID, **config), hook,
                              api_keys=api_keys, allowed_origins=allowed_origins)
        self.swap = Swap(create_loading_app(api_keys, allowed_origins)) if loading else None
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.swap or self.app, log_level="warning",
                                                    timeout_graceful_shutdown=2))
        self.app.state.lifecycle.on_drained = self.stop
        self.thread = threading.Thread(target=self.server.run,
                                       kwargs={"sockets": [self.socket]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + STARTUP_SECONDS
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, max_retries=0,
                             **{"api_key": "unused", **kwargs})

    def finish_loading(self) -> None:
        """The model is in: serve the app (its engine starts first)."""
        asyncio.run_coroutine_threadsafe(self.swap.swap(self.app), self.swap.loop).result(60)

    def drain(self, seconds: float):
        """Start a drain as SIGTERM does (the server stops once it is over); its future."""
        lifecycle = self.app.state.lifecycle
        return asyncio.run_coroutine_threadsafe(lifecycle.drain(seconds), lifecycle.loop)

    def stop(self) -> None:
        self.server.should_exit = True

    def close(self) -> None:
        self.stop()
        self.thread.join(timeout=30)
        self.socket.close()

    def wait_idle(self, seconds: float = 10.0) -> bool:
        deadline = time.monotonic() + seconds
        while self.engine.in_flight:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True


def forcing_server(model, tokenizer):
    """A `LiveServer` whose hook forces scripted replies, closed when the generator ends
    (a module fixture's body: `yield from forcing_server(*loaded)`)."""
    server = LiveServer(model, tokenizer, hook=Forcing(tokenizer))
    try:
        yield server
    finally:
        server.close()


def post(port: int, path: str, body, timeout: float = 60.0) -> tuple:
    """Raw HTTP POST: (status, decoded JSON). `body` bytes are sent as they are."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, data, {"Content-Type": "application/json"})
    response = conn.getresponse()
    status, raw = response.status, response.read()
    conn.close()
    return status, json.loads(raw)


def get(port: int, path: str) -> tuple:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", path)
    response = conn.getresponse()
    status, raw = response.status, response.read()
    conn.close()
    return status, json.loads(raw)


def one_past_the_bound(live: LiveServer, path: str, body) -> tuple:
    """Fill the engine's request bound with `body` requests held in its queue (the worker is
    kept from running), send one more, then let them run: ((status, body) of the one past the
    bound, the held requests' statuses)."""
    results = []

    def one():
        results.append(post(live.port, path, body))

    with live.engine.lock:  # nothing runs: requests pile up in the queue
        threads = [threading.Thread(target=one) for _ in range(live.engine.max_concurrent)]
        for t in threads:
            t.start()
        while live.engine.in_flight < live.engine.max_concurrent:
            threading.Event().wait(0.01)
        extra = post(live.port, path, body)
    for t in threads:
        t.join()
    return extra, sorted(status for status, _ in results)


def call(port: int, method: str, path: str, body=None, headers=None, timeout=60.0) -> tuple:
    """(status, headers with lower-case names, JSON body or text) of one raw request."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = None if body is None else json.dumps(body).encode()
    conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    raw = response.read().decode()
    conn.close()
    try:
        raw = json.loads(raw)
    except json.JSONDecodeError:
        pass
    return response.status, {k.lower(): v for k, v in response.getheaders()}, raw


def sse_lines(port: int, path: str, body: dict, into: list, started: threading.Event) -> None:
    """Read a streamed reply's lines into `into` ("data: ..." / "event: ..."); `started` is
    set once the first line came."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    into.append(response.status)
    for raw in response:
        line = raw.decode().strip()
        if line:
            into.append(line)
            started.set()
    conn.close()


def sse_data(lines: list) -> list:
    """The JSON of each `data:` line (bar [DONE])."""
    return [json.loads(line[6:]) for line in lines[1:]
            if line.startswith("data: ") and line != "data: [DONE]"]


class CliServer:
    """`python -m mlx_v41.server` on the tiny checkpoint (on a free port, with `flags`), its
    stderr collected on a thread; `ready()` waits for /health to say 200."""

    def __init__(self, *flags):
        command = [sys.executable, "-m", "mlx_v41.server", "--model",
                   str(golden_checkpoint("tiny")), "--port", "0", *flags]
        self.process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True,
                                        stdout=subprocess.DEVNULL,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: list = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.port = self._wait_for(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")

    def _read(self) -> None:
        for line in self.process.stderr:
            self.lines.append(line)

    @property
    def err(self) -> str:
        return "".join(self.lines)

    def _wait_for(self, pattern: str, seconds: float = 120) -> int:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            match = re.search(pattern, self.err)
            if match:
                return int(match.group(1))
            assert self.process.poll() is None, self.err
            time.sleep(0.05)
        raise AssertionError("the server did not start:\n" + self.err)

    def ready(self, seconds: float = 120) -> None:
        deadline = time.monotonic() + seconds
        while call(self.port, "GET", "/health")[0] != 200:
            assert time.monotonic() < deadline, self.err
            time.sleep(0.1)

    def stop(self, sig=signal.SIGTERM, seconds: float = 60) -> tuple:
        """Send `sig`; (exit status, seconds it took)."""
        tic = time.monotonic()
        self.process.send_signal(sig)
        status = self.process.wait(timeout=seconds)
        self.reader.join(10)
        return status, time.monotonic() - tic

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
