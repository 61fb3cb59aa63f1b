"""A soak run of `mlx_v41.server`: --minutes of mixed traffic from --clients concurrent clients
against one live server (uvicorn on 127.0.0.1, the batching engine, the real `openai`,
`anthropic` and `httpx` clients), the server process's resident memory sampled once a second.

Each client loops over a fixed, seeded plan of requests until the time or --max-requests is
spent (it stops by itself):

* greedy chat completions, streamed and not, whose text must equal the batch-1 greedy reply
  of the same prompt (`mlx_v41.stream_generate`, computed before the run);
* streams dropped after their first event (the client disconnects);
* forced tool calls (`tool_choice: required`, one call): the reply must end with
  `tool_calls` and carry one call;
* JSON under a schema (`response_format` json_schema): the answer must parse;
* Anthropic Messages with `tool_choice: any`: `stop_reason` must be `tool_use`;
* an image part (the tiny vision tower);
* bad bodies (not JSON, wrong types, an unknown model): each must be a 4xx.

The server runs in chat mode (`--no-thinking`) with a 64 MB prompt-cache store. Reported:
requests by kind, server errors (5xx: must be 0), greedy mismatches (must be 0), forced replies
that did not end (must be 0), and memory after warm-up (the first --warmup fraction of the run)
and at the end with the slope in MB per minute: resident memory, MLX's live arrays, its buffer
cache (freed buffers it keeps for reuse) and the prompt-cache store (which fills up to its
bound). Flat: MLX's live arrays beyond the store grow less than --flat-mb after warm-up.

    nice python benchmarks/bench_soak.py [--minutes 10 --clients 8 --max-requests 5000]
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout too
sys.path.insert(0, str(ROOT / "tests"))  # the test suite's checkpoint and server helpers

import anthropic  # noqa: E402
import httpx2 as httpx  # noqa: E402  (the HTTP client the openai and anthropic SDKs use)

import mlx_v41  # noqa: E402
from mlx_v41.server.processors import base_fields, processors_from  # noqa: E402
from server_harness import MODEL_ID, LiveServer  # noqa: E402
from vision_fixtures import SMALL_MIN_PIXELS, twin_images, vision_checkpoint  # noqa: E402

CHAT_OFF = {"chat_template_kwargs": {"thinking": False}}
WORDS = ("red", "blue", "cat", "tree", "sky", "nine", "go", "file", "line", "stack")
TOOL = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
    "additionalProperties": False}}}
KINDS = ("greedy", "greedy_stream", "drop", "forced", "schema", "anthropic", "image", "bad")


def words(k: int, n: int) -> str:
    rng = random.Random(k)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    import resource  # macOS: no /proc; ru_maxrss is the peak, in bytes there

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def batch_one(model, tokenizer, text: str, max_tokens: int) -> str:
    """The batch-1 greedy reply with a chat reply's processors (special tokens masked)."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                        enable_thinking=False)
    processors = processors_from(base_fields(True), tokenizer)
    return "".join(r.text for r in mlx_v41.stream_generate(
        model, tokenizer, ids, max_tokens=max_tokens, logits_processors=processors))


class Soak:
    def __init__(self, server: LiveServer, texts: list, want: list, image_uri: str,
                 max_tokens: int):
        self.server, self.texts, self.want = server, texts, want
        self.image_uri, self.max_tokens = image_uri, max_tokens
        self.counts, self.failures = Counter(), Counter()
        self.notes: list = []
        self.lock = threading.Lock()

    def fail(self, kind: str, what: str) -> None:
        with self.lock:
            self.failures[kind] += 1
            if len(self.notes) < 20:
                self.notes.append(f"{kind}: {what}")

    def run_one(self, kind: str, k: int, http: httpx.Client, clients: tuple) -> None:
        openai_client, anthropic_client = clients
        base, text = f"http://127.0.0.1:{self.server.port}", self.texts[k]
        sdk = {"model": MODEL_ID, "messages": [{"role": "user", "content": text}],
               "max_tokens": self.max_tokens, "extra_body": CHAT_OFF}
        chat = {"model": MODEL_ID, "messages": sdk["messages"], "max_tokens": self.max_tokens,
                **CHAT_OFF}
        if kind in ("greedy", "greedy_stream"):
            client = openai_client
            if kind == "greedy":
                reply = client.chat.completions.create(**sdk)
                got = reply.choices[0].message.content
            else:
                got = "".join(c.choices[0].delta.content or "" for c in
                              client.chat.completions.create(**sdk, stream=True)
                              if c.choices)
            if got != self.want[k]:
                self.fail("mismatch", f"{kind} prompt {k}: {got!r} != {self.want[k]!r}")
        elif kind == "drop":
            with http.stream("POST", f"{base}/v1/chat/completions",
                             json=dict(chat, stream=True)) as response:
                self.check_status(kind, response.status_code)
                next(response.iter_lines())  # the first event, then hang up
        elif kind == "forced":
            reply = openai_client.chat.completions.create(
                **dict(sdk, max_tokens=200), tools=[TOOL], tool_choice="required",
                parallel_tool_calls=False)
            choice = reply.choices[0]
            if choice.finish_reason != "tool_calls" or len(choice.message.tool_calls or []) != 1:
                self.fail("unended", f"forced call: finish {choice.finish_reason}, "
                                     f"{reply.usage.completion_tokens} tokens")
        elif kind == "schema":
            reply = openai_client.chat.completions.create(
                **dict(sdk, max_tokens=200), response_format=SCHEMA)
            try:
                json.loads(reply.choices[0].message.content)
            except (TypeError, ValueError):
                self.fail("unended", f"schema answer {reply.choices[0].message.content!r}")
        elif kind == "anthropic":
            message = anthropic_client.messages.create(
                model=MODEL_ID, max_tokens=200, messages=[{"role": "user", "content": text}],
                tools=[{"name": "pick", "input_schema": TOOL["function"]["parameters"]}],
                tool_choice={"type": "any", "disable_parallel_tool_use": True})
            if message.stop_reason != "tool_use":
                self.fail("unended", f"anthropic forced call: {message.stop_reason}")
        elif kind == "image":
            content = [{"type": "image_url", "image_url": {"url": self.image_uri}},
                       {"type": "text", "text": text}]
            response = http.post(f"{base}/v1/chat/completions",
                                 json=dict(chat, messages=[{"role": "user", "content": content}]))
            self.check_status(kind, response.status_code, ok=(200,))
        else:  # bad bodies: each must be refused with a 4xx
            bodies = [b"{not json", json.dumps(dict(chat, max_tokens="5")).encode(),
                      json.dumps(dict(chat, model="nope")).encode(), b"[]"]
            response = http.post(f"{base}/v1/chat/completions", content=bodies[k % len(bodies)],
                                 headers={"Content-Type": "application/json"})
            self.check_status(kind, response.status_code, ok=range(400, 500))
        with self.lock:
            self.counts[kind] += 1

    def check_status(self, kind: str, status: int, ok=(200,)) -> None:
        if status >= 500:
            self.fail("server_error", f"{kind}: HTTP {status}")
        elif status not in ok:
            self.fail("unexpected", f"{kind}: HTTP {status}")

    def client_loop(self, seed: int, deadline: float, budget: list) -> None:
        rng = random.Random(seed)
        # one of each client per thread, reused (as an agent does; clients made per request
        # would count their own connection pools in this process's memory)
        clients = (self.server.client(),
                   anthropic.Anthropic(base_url=f"http://127.0.0.1:{self.server.port}",
                                       api_key="unused", max_retries=0))
        with httpx.Client(timeout=120) as http:
            while time.monotonic() < deadline:
                with self.lock:
                    if budget[0] <= 0:
                        return
                    budget[0] -= 1
                kind, k = rng.choice(KINDS), rng.randrange(len(self.texts))
                try:
                    self.run_one(kind, k, http, clients)
                except Exception as e:  # noqa: BLE001 - a client-side failure is a finding
                    status = getattr(getattr(e, "response", None), "status_code", None) or \
                        getattr(e, "status_code", None)
                    name = "server_error" if status and status >= 500 else "exception"
                    self.fail(name, f"{kind}: {type(e).__name__}: {e}"[:300])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-requests", type=int, default=5000)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--warmup", type=float, default=0.3,
                        help="fraction of the run before memory is measured")
    parser.add_argument("--flat-mb", type=float, default=64.0)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        folder = vision_checkpoint(Path(tmp) / "hf", SMALL_MIN_PIXELS)
        model, tokenizer = mlx_v41.load(folder, dspark=False)
        texts = [words(k, 3 + 11 * (k % 9)) for k in range(12)]
        want = [batch_one(model, tokenizer, t, args.max_tokens) for t in texts]
        image = base64.b64encode(twin_images(Path(tmp))[0].read_bytes()).decode()
        # chat mode by default (`--no-thinking`): free reasoning on a random model need not end
        server = LiveServer(model, tokenizer, max_concurrent=64, cache_bytes=64 << 20,
                            thinking=False)
        soak = Soak(server, texts, want, f"data:image/png;base64,{image}", args.max_tokens)
        samples, stop = [], threading.Event()

        def measure():
            return (time.monotonic(), rss_bytes(), mx.get_active_memory(),
                    mx.get_cache_memory(), server.store.nbytes)

        def sample():
            while not stop.wait(1.0):
                samples.append(measure())

        sampler = threading.Thread(target=sample, daemon=True)
        start = time.monotonic()
        deadline, budget = start + 60 * args.minutes, [args.max_requests]
        sampler.start()
        clients = [threading.Thread(target=soak.client_loop, args=(seed, deadline, budget))
                   for seed in range(args.clients)]
        for t in clients:
            t.start()
        for t in clients:
            t.join()
        server.wait_idle(30)
        stop.set()
        sampler.join()
        samples.append(measure())
        server.close()

    elapsed = samples[-1][0] - start
    measured = np.array([m for m in samples if m[0] - start >= args.warmup * elapsed], float)
    t = measured[:, 0] - measured[0, 0]
    mb = measured[:, 1:] / 2**20  # rss, MLX active, MLX cache, prompt-cache store

    def trend(column) -> tuple:
        values = mb[:, column] if isinstance(column, int) else column
        slope = np.polyfit(t, values, 1)[0] * 60 if len(t) > 2 else float("nan")
        return values[0], values[-1], values[-1] - values[0], slope
    print(f"{sum(soak.counts.values())} requests in {elapsed / 60:.1f} min from "
          f"{args.clients} clients: " + ", ".join(f"{k} {soak.counts[k]}" for k in KINDS))
    print("failures: " + (", ".join(f"{k} {v}" for k, v in soak.failures.items()) or "none"))
    for note in soak.notes:
        print("  " + note)
    print(f"memory over the {t[-1] / 60:.1f} min after warm-up (MB: start -> end, growth, "
          f"slope per min):")
    for name, column in (("resident (RSS)", 0), ("MLX active", 1), ("MLX buffer cache", 2),
                         ("prompt-cache store", 3),
                         ("MLX active beyond the store", mb[:, 1] - mb[:, 3])):
        first, last, growth, slope = trend(column)
        print(f"  {name:28s} {first:7.0f} -> {last:7.0f}  {growth:+6.0f}  {slope:+6.1f}")
    leak = trend(mb[:, 1] - mb[:, 3])[2]
    print(f"live arrays beyond the prompt-cache store: "
          f"{'flat' if leak < args.flat_mb else 'GROWING'} (growth {leak:+.0f} MB, "
          f"bound {args.flat_mb:.0f} MB)")


if __name__ == "__main__":
    main()
