"""`mlx_v41.server` batching (`BatchEngine`) against the one-at-a-time `Engine`, on one loaded
checkpoint in one run, through the real `openai` client streaming over HTTP on 127.0.0.1.

1. Load: --clients concurrent clients each send --requests-per-client chat requests one after
   another (distinct prompts of --min-prompt to --max-prompt tokens, spread evenly and shuffled;
   greedy, chat mode, --reply-tokens). Prompt-cache reuse is off, so every request prefills its
   whole prompt. Reported: generated tokens/s over the wall time, time to first token (request
   sent to first content delta) and inter-token latency (between content deltas of a stream),
   p50 / p95 over all requests. Greedy replies must be the same text on both servers (the
   batch is exact per sequence): the mismatches are counted.
2. Short behind long: a request with a --long-tokens prompt is sent; --short-delay s after the
   server holds it, a --short-tokens request follows. Reported: the short request's time to
   first token (the serial engine makes it wait for the whole long request).

Both servers share the loaded model and --prefill-step-size; they take turns, each measured
while the other is idle, --repeats times, the order alternating per repeat. The clients run in
threads of the same process as the servers, on the same cores.

    nice python benchmarks/bench_server_batch.py [--model PATH --clients 16
        --requests-per-client 2 --reply-tokens 32 --long-tokens 3000 --repeats 3]
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout too

import mlx_v41  # noqa: E402
from mlx_v41.server import Engine, PromptCacheStore  # noqa: E402
from mlx_v41.server.engine.batch import BatchEngine  # noqa: E402
from bench_server import Server  # noqa: E402  (this folder: the script's own)

CHECKPOINT = ROOT / "tests/data/goldens/tiny/hf"
FILLER = ("The parser reads the file line by line, keeps a stack of open blocks and reports the "
          "first unmatched bracket with its line and column. Tests cover empty files, tabs, "
          "unicode names and very long lines. ")
NAMES = ("batched", "serial")


@dataclass
class Reply:
    """One streamed request as its client saw it."""

    text: str = ""
    ttft: float = 0.0  # s from sending to the first content delta
    total: float = 0.0
    gaps: list = field(default_factory=list)  # s between content deltas
    generated: int = 0
    prompt: int = 0
    cached: int = 0


def make_server(model, tokenizer, batched: bool, step: int, max_concurrent: int) -> Server:
    """A batching or serial engine's app (bench_server.py's `Server`), without prompt reuse:
    every request prefills its prompt."""
    store = PromptCacheStore(model, 0)
    options = {"prefill_step_size": step, "max_concurrent": max_concurrent}
    engine = BatchEngine(model, tokenizer, store, **options) if batched \
        else Engine(model, tokenizer, store, **options)
    return Server(engine)


def wait_idle(server: Server) -> None:
    while server.engine.in_flight:
        time.sleep(0.05)


def stream(client, content: str, reply_tokens: int) -> Reply:
    """Send one greedy chat request, streamed; time its content deltas."""
    reply, tic, last = Reply(), time.perf_counter(), None
    chunks = client.chat.completions.create(
        model="bench", messages=[{"role": "user", "content": content}], max_tokens=reply_tokens,
        temperature=0.0, stream=True, stream_options={"include_usage": True})
    for chunk in chunks:
        if chunk.usage is not None:
            reply.generated, reply.prompt = chunk.usage.completion_tokens, \
                chunk.usage.prompt_tokens
            details = chunk.usage.prompt_tokens_details
            reply.cached = details.cached_tokens if details else 0
        for choice in chunk.choices:
            if choice.delta.content:
                now = time.perf_counter()
                if last is None:
                    reply.ttft = now - tic
                else:
                    reply.gaps.append(now - last)
                last = now
                reply.text += choice.delta.content
    reply.total = time.perf_counter() - tic
    if last is None:
        reply.ttft = reply.total
    return reply


def prompt_text(tokenizer, tag: str, tokens: int) -> str:
    """A distinct user message of about `tokens` tokens."""
    text = f"Request {tag}. " + FILLER * (tokens // 40 + 2)
    return tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:tokens])


def client_prompts(tokenizer, args) -> list:
    """Per client, its prompts: lengths spread evenly over the range, shuffled among clients."""
    count = args.clients * args.requests_per_client
    lengths = np.linspace(args.min_prompt, args.max_prompt, count).round().astype(int).tolist()
    random.Random(0).shuffle(lengths)
    texts = [prompt_text(tokenizer, f"{k} of {count}", n) for k, n in enumerate(lengths)]
    per = args.requests_per_client
    return [texts[c * per:(c + 1) * per] for c in range(args.clients)]


def run_load(server: Server, prompts: list, reply_tokens: int) -> tuple:
    """(wall s, {(client, k): Reply}) of every client sending its prompts in turn."""
    replies, start = {}, threading.Barrier(len(prompts) + 1)

    def client_loop(c: int):
        client = server.client
        start.wait()
        for k, text in enumerate(prompts[c]):
            replies[c, k] = stream(client, text, reply_tokens)

    threads = [threading.Thread(target=client_loop, args=(c,)) for c in range(len(prompts))]
    for thread in threads:
        thread.start()
    start.wait()
    tic = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - tic
    wait_idle(server)
    return wall, replies


def run_short_behind_long(server: Server, long: str, short: str, reply_tokens: int,
                          delay: float) -> tuple:
    """(long Reply, short Reply): the short request sent `delay` s after the long one is held."""
    out = {}
    thread = threading.Thread(target=lambda: out.update(
        long=stream(server.client, long, reply_tokens)))
    thread.start()
    while not server.engine.in_flight and thread.is_alive():
        time.sleep(0.005)
    time.sleep(delay)
    out["short"] = stream(server.client, short, reply_tokens)
    thread.join()
    wait_idle(server)
    return out["long"], out["short"]


def percentile(values: list, q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def load_row(walls: list, runs: list) -> dict:
    """Aggregate the load phase's repeats of one server."""
    replies = [r for run in runs for r in run.values()]
    gaps = [g for r in replies for g in r.gaps]
    return {"tps": sum(r.generated for r in replies) / sum(walls),
            "ttft50": percentile([r.ttft for r in replies], 50),
            "ttft95": percentile([r.ttft for r in replies], 95),
            "itl50": percentile(gaps, 50), "itl95": percentile(gaps, 95),
            "wall": float(np.median(walls)), "walls": walls,
            "generated": sum(r.generated for r in replies),
            "prompt": [r.prompt for r in replies], "cached": sum(r.cached for r in replies)}


def mismatches(runs: dict) -> tuple:
    """(prompts whose replies differ between or within the servers, prompts)."""
    keys = runs["batched"][0].keys()
    differing = sum(len({run[key].text for name in NAMES for run in runs[name]}) > 1
                    for key in keys)
    return differing, len(keys)


def print_load(rows: dict, args) -> None:
    ms = 1000.0
    print(f"\n| {args.clients} clients x {args.requests_per_client} requests | generated tok/s "
          f"| TTFT p50 / p95 ms | inter-token p50 / p95 ms | wall s (each repeat) |")
    print("|---|---|---|---|---|")
    for name in NAMES:
        r = rows[name]
        walls = " / ".join(f"{w:.1f}" for w in r["walls"])
        print(f"| {name} | {r['tps']:.1f} | {r['ttft50'] * ms:.0f} / {r['ttft95'] * ms:.0f} | "
              f"{r['itl50'] * ms:.0f} / {r['itl95'] * ms:.0f} | {walls} |")
    b, s = rows["batched"], rows["serial"]
    print(f"| **batched / serial** | **{b['tps'] / s['tps']:.2f}x** | "
          f"{b['ttft50'] / s['ttft50']:.2f}x / {b['ttft95'] / s['ttft95']:.2f}x | "
          f"{b['itl50'] / s['itl50']:.2f}x / {b['itl95'] / s['itl95']:.2f}x | "
          f"{b['wall'] / s['wall']:.2f}x (median) |")


def print_long(pairs: dict, args) -> None:
    ms = 1000.0
    print(f"\n| short behind long ({args.long_tokens}-token prompt, chunks of "
          f"{args.prefill_step_size}) | short TTFT ms (each repeat) | long TTFT ms "
          f"| long total s |")
    print("|---|---|---|---|")
    med = {}
    for name in NAMES:
        longs, shorts = zip(*pairs[name])
        med[name] = float(np.median([s.ttft for s in shorts]))
        print(f"| {name} | {med[name] * ms:.0f} ("
              + " / ".join(f"{s.ttft * ms:.0f}" for s in shorts) + ") | "
              f"{np.median([r.ttft for r in longs]) * ms:.0f} | "
              f"{np.median([r.total for r in longs]):.1f} |")
    print(f"| **batched / serial** | **{med['batched'] / med['serial']:.3f}x** "
          f"({med['serial'] / med['batched']:.1f}x shorter) | | |")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(CHECKPOINT))
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--min-prompt", type=int, default=20)
    parser.add_argument("--max-prompt", type=int, default=400)
    parser.add_argument("--reply-tokens", type=int, default=32)
    parser.add_argument("--long-tokens", type=int, default=3000)
    parser.add_argument("--short-tokens", type=int, default=64)
    parser.add_argument("--short-delay", type=float, default=1.0,
                        help="s between the server holding the long request and the short one")
    parser.add_argument("--prefill-step-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args()


def main():
    args = parse_args()
    model, tokenizer = mlx_v41.load(args.model, dspark=False)  # as mlx_v41.server loads it
    servers = {name: make_server(model, tokenizer, name == "batched", args.prefill_step_size,
                            max(64, 2 * args.clients)) for name in NAMES}
    prompts = client_prompts(tokenizer, args)
    long = prompt_text(tokenizer, "long", args.long_tokens)
    short = prompt_text(tokenizer, "short", args.short_tokens)
    for server in servers.values():  # warm-up (not timed): a small concurrent load
        run_load(server, [[short], [short]], 4)
    walls = {name: [] for name in NAMES}
    runs = {name: [] for name in NAMES}
    pairs = {name: [] for name in NAMES}
    for repeat in range(args.repeats):
        order = NAMES if repeat % 2 == 0 else NAMES[::-1]
        for name in order:
            wall, replies = run_load(servers[name], prompts, args.reply_tokens)
            walls[name].append(wall)
            runs[name].append(replies)
            print(f"repeat {repeat + 1}, {name}: load {wall:.1f} s", flush=True)
        for name in order:
            pairs[name].append(run_short_behind_long(servers[name], long, short,
                                                     args.reply_tokens, args.short_delay))
            print(f"repeat {repeat + 1}, {name}: short TTFT "
                  f"{pairs[name][-1][1].ttft * 1000:.0f} ms", flush=True)
    rows = {name: load_row(walls[name], runs[name]) for name in NAMES}
    report(rows, runs, pairs, servers, args)
    for server in servers.values():
        server.close()


def report(rows: dict, runs: dict, pairs: dict, servers: dict, args) -> None:
    prompt = rows["batched"]["prompt"]
    print(f"\n{args.model}: {args.clients} clients x {args.requests_per_client} requests, prompts "
          f"{min(prompt)}-{max(prompt)} tokens (mean {np.mean(prompt):.0f}, chat template "
          f"included), {args.reply_tokens} reply tokens, greedy, chat mode, prefill step "
          f"{args.prefill_step_size}, {args.repeats} repeats; generated "
          f"{rows['batched']['generated']} / {rows['serial']['generated']} tokens, cached prompt "
          f"tokens {rows['batched']['cached']} / {rows['serial']['cached']} (batched / serial)")
    print_load(rows, args)
    print_long(pairs, args)
    differing, count = mismatches(runs)
    longs = {(r.text, s.text) for name in NAMES for r, s in pairs[name]}
    print(f"\nreplies that differ between the servers (or repeats): {differing} of {count} load "
          f"prompts; short-behind-long pairs: {len(longs) - 1} differing")
    print(f"batched engine: {servers['batched'].engine.steps} steps, at most "
          f"{servers['batched'].engine.peak_batch} requests in the batch")


if __name__ == "__main__":
    main()
