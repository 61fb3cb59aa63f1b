"""`mlx_v41.server` with and without its prompt cache, on one checkpoint in one run: requests/s
and time to first token (TTFT) of a repeated multi-turn conversation, streamed through the
real `openai` client over HTTP on 127.0.0.1.

The conversation: a long system prompt (an agent's instructions), then --turns user turns of a
sentence each, every reply (greedy, chat mode, --reply-tokens) sent back as the assistant
message, as agents do. Two servers share the loaded model and take turns (never concurrent):
`--prompt-cache-bytes 0` (no reuse: every turn prefills the whole conversation) and the
default store. The conversation runs --repeats times per server, the servers alternating, so
load from other processes falls on both alike; TTFT is the median over all turns, requests/s
the turns over their total time.

    python benchmarks/bench_server.py [--model PATH --system-chars 3000 --turns 6
                                       --reply-tokens 8 --repeats 2]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout too
import openai  # noqa: E402
import uvicorn  # noqa: E402

import mlx_v41  # noqa: E402
from mlx_v41.server import Engine, PromptCacheStore, ServerConfig, create_app  # noqa: E402

CHECKPOINT = ROOT / "tests/data/goldens/tiny/hf"
INSTRUCTIONS = ("You are a coding agent. Read the repository, plan the change, edit files "
                "with the tools, run the tests and report what you did. Keep answers short. ")
QUESTIONS = ["What does the parser do?", "Where is the cache trimmed?", "Add a test for it.",
             "Run the tests.", "Why did one fail?", "Fix it and summarise."]


class Server:
    """`create_app(engine)` on a free loopback port, served by uvicorn in a thread."""

    def __init__(self, engine):
        self.engine, self.store = engine, engine.store
        app = create_app(engine, ServerConfig(model_id="bench", thinking=False))
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True,
                                       kwargs={"sockets": [self.socket]})
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}/v1"
        self.client = openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0,
                                    timeout=900)

    def close(self):
        self.server.should_exit = True
        self.thread.join()


def turn(client, messages: list, reply_tokens: int) -> tuple:
    """(reply text, TTFT s, total s, cached tokens) of one streamed turn."""
    tic, first, text, usage = time.perf_counter(), None, "", None
    stream = client.chat.completions.create(model="bench", messages=messages,
                                            max_tokens=reply_tokens, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content and first is None:
                first = time.perf_counter() - tic
            text += choice.delta.content or ""
    total = time.perf_counter() - tic
    return text, first if first is not None else total, total, \
        usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens


def conversation(server: Server, system: str, turns: int, reply_tokens: int) -> list:
    messages, rows = [{"role": "system", "content": system}], []
    for k in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[k % len(QUESTIONS)]})
        text, ttft, total, cached, prompt = turn(server.client, messages, reply_tokens)
        messages.append({"role": "assistant", "content": text})
        rows.append((ttft, total, cached, prompt))
    return rows


def report(name: str, rows: list) -> dict:
    total = sum(r[1] for r in rows)
    out = {"rps": len(rows) / total, "ttft": statistics.median(r[0] for r in rows),
           "cached": sum(r[2] for r in rows) / sum(r[3] for r in rows),
           "prompt": statistics.mean(r[3] for r in rows)}
    print(f"{name:>14}: {out['rps']:.3f} requests/s, median TTFT {out['ttft'] * 1000:.0f} ms, "
          f"{out['cached']:.1%} of prompt tokens cached (mean prompt {out['prompt']:.0f} "
          f"tokens, {len(rows)} requests)")
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(CHECKPOINT))
    parser.add_argument("--system-chars", type=int, default=3000)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--reply-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    model, tokenizer = mlx_v41.load(args.model)
    system = (INSTRUCTIONS * (args.system_chars // len(INSTRUCTIONS) + 1))[:args.system_chars]
    servers = {"no cache": Server(Engine(model, tokenizer, PromptCacheStore(model, 0))),
               "prompt cache": Server(Engine(model, tokenizer,
                                             PromptCacheStore(model, 4 * 10**9)))}
    conversation(servers["no cache"], system, 1, 1)  # warm-up (not timed)
    rows = {name: [] for name in servers}
    for _ in range(args.repeats):
        for name, server in servers.items():
            rows[name] += conversation(server, system, args.turns, args.reply_tokens)
    print(f"{args.model}: system prompt {args.system_chars} chars, {args.turns} turns x "
          f"{args.repeats} repeats, {args.reply_tokens} reply tokens, greedy, chat mode")
    off, on = (report(name, rows[name]) for name in servers)
    print(f"{'ratio':>14}: {on['rps'] / off['rps']:.2f}x requests/s, "
          f"TTFT {off['ttft'] / on['ttft']:.2f}x shorter with the cache")
    print(f"prompt-cache store: {len(servers['prompt cache'].store.entries)} entries, "
          f"{servers['prompt cache'].store.nbytes / 2**20:.2f} MiB")
    for server in servers.values():
        server.close()


if __name__ == "__main__":
    main()
