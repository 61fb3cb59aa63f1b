"""A live `mlx_v41.server` for tests: uvicorn on 127.0.0.1 on a free port in a background
thread, the real `openai` client, raw HTTP, and a logits processor that forces a reply."""

from __future__ import annotations

import functools
import http.client
import json
import socket
import threading
import time
from pathlib import Path

import mlx.core as mx
import openai
import uvicorn

import mlx_v41
from mlx_v41.chat import format as cf
from mlx_v41.server import Engine, PromptCacheStore, ServerConfig, create_app
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
    """`create_app` served by uvicorn in a thread; `close()` shuts it down like Ctrl-C. The
    engine batches (`BatchEngine`, with `batching` options) as `mlx_v41.server` does, unless
    `serial` or a `draft` asks for the one-at-a-time `Engine`."""

    def __init__(self, model, tokenizer, *, folder=None, cache_bytes=1 << 30,
                 max_concurrent=8, draft=None, hook=None, serial=False, batching=None,
                 **config):
        self.hook = hook
        self.store = PromptCacheStore(model, cache_bytes, folder)
        if serial or draft:
            self.engine = Engine(model, tokenizer, self.store, max_concurrent=max_concurrent,
                                 draft=draft)
        else:
            self.engine = BatchEngine(model, tokenizer, self.store,
                                      max_concurrent=max_concurrent, **(batching or {}))
        self.app = create_app(self.engine, ServerConfig(model_id=MODEL_ID, **config), hook)
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning",
                                                    timeout_graceful_shutdown=2))
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
        return openai.OpenAI(base_url=self.base_url, api_key="unused", max_retries=0,
                             **kwargs)

    def close(self) -> None:
        self.server.should_exit = True
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
