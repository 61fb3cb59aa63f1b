"""Continuous batching: aggregate decode tokens/s of B sequences decoded together against the
same sequences decoded one after another, a Mac's bytes per batched step, and sessions per
machine.

1. speed, on bench_vs_mlx_lm's CPU checkpoint (tests/checkpoint_factory.py: the published 40 + 3
   layer schedule at hidden 128, vocabulary 8192, window 32, index top-128; --engram keeps the
   factory's Engram layers 1 and 14). One random prompt of --max-context tokens is prefilled
   once, in pieces, and the cache kept (`mlx_v41.copy_cache`) at max(--sizes) lengths spread
   between --min-context and --max-context, in an order where the first B of them span the
   range for every B. Each sequence first feeds its prompt's greedy token. The checkpoint's
   DSpark drafter is loaded, as bench_vs_mlx_lm loads it, so every step also writes the
   drafter's rings. At each B, after a warm-up step, --repeats times in turn: --steps greedy
   steps of the first B sequences, one `batch_forward` per step; the same through
   `BatchGenerator` (its `generation_tps`); the same B sequences one after another at batch 1
   (`model(ids, cache=...)` per token). Each path's fastest repeat is reported (the machine is
   shared: the least disturbed run). Every run decodes fresh copies of the caches; each
   sequence's greedy tokens (and, batched against sequential, logits) must be bit-identical
   across the three.
2. --real-width: the same at bench_real_width's widths (hidden 5120, 64 heads x 512, experts
   2304 wide, 6 of 8 per token, 6 layers) at --real-sizes, one repeat, without the engine.
3. a Mac's roofline, computed on the official config: weight bytes one batched decode step reads
   at B (every weight but the routed experts once; per layer the expected distinct experts that
   B tokens choosing top-6 of 384 touch, 384 * (1 - (1 - 6/384)^B), assuming uniform independent
   routing), plus B sequences' cache rows at --roofline-context, and tokens/s at --bandwidth
   (Engram table rows and the drafter left out).
4. memory: sessions that fit --mac-memory at 128K and 1M tokens (`mlx_v41.model.memory`, what
   `mlx_v41.inspect` prints), and measured: `mlx_v41.cache_bytes` per session of the speed run,
   and the engine holding the largest B sessions against the sum of the same sessions alone.

5. --pipeline B...: `BatchGenerator.next()` pipelined (the default) against each step
   evaluated before it returns (`pipelined=False`): median step time, the host's part of the
   latter (outside `mx.eval`), and the share of it the pipelining hides.

    python benchmarks/bench_batch.py [--sizes 1 2 4 8 16 32 --max-context 4096 --steps 12]
    python benchmarks/bench_batch.py --skip-cpu --pipeline 1 8 32
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # run from a checkout; the factory is a test helper

import mlx_v41  # noqa: E402
from benchmarks.bench_real_width import REAL  # noqa: E402
from benchmarks.bench_vs_mlx_lm import PUBLISHED_POOL, VOCAB, cache_arrays  # noqa: E402
from checkpoint_factory import schedule_text_config, without_engram, write_checkpoint  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_v41.cli.inspect import parse_bytes, parse_count  # noqa: E402
from mlx_v41.model.batch import batch_forward  # noqa: E402
from mlx_v41.model.config import ModelArgs, official_config_path  # noqa: E402
from mlx_v41.model.memory import (fixed_cache_bytes, global_bytes_per_token,  # noqa: E402
                                  session_bytes, weight_bytes)
from mlx_v41.model.schedule import layer_roles  # noqa: E402

TARGETS = {8: 3.3, 32: 4.5}  # batched / sequential targets on this CPU (the batch-path issue)
CONTEXTS = ("128K", "1M")


@dataclass
class Session:
    """A prefilled prompt: its cache (never advanced: runs decode copies) and first token."""

    length: int
    cache: list
    first: int


@dataclass
class Run:
    seconds: float
    tokens: list  # [B][steps] greedy ids
    logits: list  # [B] arrays [steps, vocab]
    caches: list


# ------------------------------------------------------------------ sequences


def radical_inverse(i: int) -> float:
    """Base-2 van der Corput: 0, 1/2, 1/4, 3/4, ...: every prefix spreads over [0, 1)."""
    x, f = 0.0, 0.5
    while i:
        x, i, f = x + f * (i & 1), i >> 1, f / 2
    return x


def mixed_lengths(n: int, lo: int, hi: int) -> list:
    top = max(radical_inverse(i) for i in range(n)) or 1.0
    return [round(lo + (hi - lo) * radical_inverse(i) / top) for i in range(n)]


def prefill_sessions(model, lengths: list, step: int, seed: int = 0) -> list:
    """One random prompt prefilled in pieces, its cache kept at each length."""
    rng = np.random.default_rng(seed)
    ids = mx.array(rng.integers(3, model.cfg.vocab_size, (1, max(lengths))), dtype=mx.int32)
    cache, done, made = model.make_cache(), 0, {}
    for length in sorted(set(lengths)):
        logits = model.prefill(ids[:, done:length], cache, step_size=step)
        mx.eval(logits, cache_arrays(cache))
        made[length] = Session(length, mlx_v41.copy_cache(cache), mx.argmax(logits[0, -1]).item())
        done = length
    return [made[n] for n in lengths]


# ------------------------------------------------------------------ the three ways to decode


def greedy(forward, ids: mx.array, steps: int) -> tuple:
    """`steps` greedy steps of `forward` (ids [B, 1] -> logits [B, vocab]): tokens, logits
    [B, steps, vocab] and seconds (the token and logits evaluated every step)."""
    tokens, logits_seen = [], []
    tic = time.perf_counter()
    for _ in range(steps):
        logits = forward(ids)
        ids = mx.argmax(logits, axis=-1, keepdims=True).astype(mx.int32)
        mx.eval(ids, logits)
        tokens.append(ids)
        logits_seen.append(logits)
    seconds = time.perf_counter() - tic
    return mx.concatenate(tokens, 1).tolist(), mx.stack(logits_seen, 1), seconds


def run_batched(model, sessions: list, steps: int) -> Run:
    caches = [mlx_v41.copy_cache(s.cache) for s in sessions]
    ids = mx.array([[s.first] for s in sessions], dtype=mx.int32)
    tokens, logits, seconds = greedy(
        lambda x: batch_forward(model, x, caches).logits[:, -1], ids, steps)
    return Run(seconds, tokens, list(logits), caches)


def run_sequential(model, sessions: list, steps: int) -> Run:
    run = Run(0.0, [], [], [])
    for s in sessions:
        cache = mlx_v41.copy_cache(s.cache)
        tokens, logits, seconds = greedy(
            lambda x: model(x, cache=cache, last_only=True)[:, -1],
            mx.array([[s.first]], dtype=mx.int32), steps)
        run.seconds += seconds
        run.tokens += tokens
        run.logits.append(logits[0])
        run.caches.append(cache)
    return run


def run_engine(model, sessions: list, steps: int) -> tuple:
    """`BatchGenerator` with each sequence's first token as a one-token prompt on its cache:
    generation tok/s, tokens, and {uid: cache_bytes} when each cache held length + steps
    positions (what the other two runs end with)."""
    engine = mlx_v41.BatchGenerator(model, max_tokens=steps, completion_batch_size=len(sessions),
                                    prefill_batch_size=len(sessions))
    uids = engine.insert([[s.first] for s in sessions],
                         caches=[mlx_v41.copy_cache(s.cache) for s in sessions])
    ends = {uid: s.length + steps for uid, s in zip(uids, sessions)}
    tokens, held = {uid: [] for uid in uids}, {}
    with engine.stats() as stats:
        while len(engine):
            for r in engine.next():
                if r.finish_reason == "error":
                    raise r.error
                tokens[r.uid].append(r.token)
            if len(engine.sequences) == len(uids) and all(
                    q.cache[0].offset == ends[q.uid] for q in engine.sequences):
                held = {q.uid: mlx_v41.cache_bytes(q.cache) for q in engine.sequences}
    return stats.generation_tps, [tokens[uid] for uid in uids], [held.get(u) for u in uids]


def identical(a: Run, b: Run) -> tuple:
    """(tokens equal, logits bitwise equal) for every sequence."""
    same_logits = all(mx.array_equal(x, y).item() for x, y in zip(a.logits, b.logits))
    return a.tokens == b.tokens, same_logits


# ------------------------------------------------------------------ speed


def speed(model, sessions: list, sizes: list, steps: int, repeats: int,
          engine: bool = True) -> dict:
    """The table rows per B (each path's fastest of `repeats`, the paths in turns within
    each repeat) and the largest B's runs (for the memory check)."""
    run_sequential(model, sessions[:1], 2)  # warm-up
    rows, last = [], None
    for b in sizes:
        part = sessions[:b]
        run_batched(model, part, 1)  # warm-up at this batch shape
        row = dict(b=b, lo=min(s.length for s in part), hi=max(s.length for s in part),
                   batched=0.0, engine=None, sequential=0.0, same=(True, True),
                   engine_same=None)
        for _ in range(repeats):
            last = one_repeat(model, part, steps, engine, row)
        rows.append(row)
        print_row(row)
    return dict(rows=rows, last=last)


def one_repeat(model, part: list, steps: int, engine: bool, row: dict) -> dict:
    """Batched, engine, sequential in turn; the row keeps each path's best and whether every
    run agreed."""
    batched = run_batched(model, part, steps)
    held = None
    if engine:
        tps, tokens, held = run_engine(model, part, steps)
        row["engine"] = max(row["engine"] or 0.0, tps)
        row["engine_same"] = row["engine_same"] in (None, True) and tokens == batched.tokens
    sequential = run_sequential(model, part, steps)
    row["batched"] = max(row["batched"], len(part) * steps / batched.seconds)
    row["sequential"] = max(row["sequential"], len(part) * steps / sequential.seconds)
    row["same"] = tuple(a and b for a, b in zip(row["same"], identical(batched, sequential)))
    return dict(batched=batched, sequential=sequential, held=held, sessions=part)


def print_row(r: dict) -> None:
    engine = "" if r["engine"] is None else (
        f", engine {r['engine']:.2f} tok/s ({r['engine'] / r['sequential']:.2f}x, tokens "
        f"{'identical' if r['engine_same'] else 'DIFFER'})")
    print(f"  B={r['b']:3d} contexts {r['lo']}-{r['hi']}: batched {r['batched']:.2f} tok/s, "
          f"sequential {r['sequential']:.2f} tok/s, ratio {r['batched'] / r['sequential']:.2f}x"
          f"{engine}; tokens {'identical' if r['same'][0] else 'DIFFER'}, logits "
          f"{'bit-identical' if r['same'][1] else 'DIFFER'}", flush=True)


def speed_table(rows: list) -> None:
    print("\n| B | contexts | `batch_forward` tok/s | `BatchGenerator` tok/s | sequential tok/s "
          "| batched / sequential | engine / sequential | target | greedy tokens, logits |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        engine = ("-", "-") if r["engine"] is None else (
            f"{r['engine']:.2f}", f"{r['engine'] / r['sequential']:.2f}x")
        target = TARGETS.get(r["b"])
        ratio = r["batched"] / r["sequential"]
        goal = "" if target is None else \
            f">= {target:g}x: {'met' if ratio >= target else 'not met'}"
        same = "identical" if all(r["same"]) and r["engine_same"] in (None, True) else "DIFFER"
        print(f"| {r['b']} | {r['lo']:,}-{r['hi']:,} | {r['batched']:.2f} | {engine[0]} | "
              f"{r['sequential']:.2f} | **{ratio:.2f}x** | {engine[1]} | {goal} | {same} |")


# ------------------------------------------------------------------ memory, measured


def measured_memory(model, last: dict, steps: int) -> None:
    """cache_bytes per session after the runs (batched == sequential == formula?), and the
    engine's B sessions against the sum of the same sessions alone."""
    cfg, seq = model.cfg, last["sequential"]
    print(f"\nMeasured cache bytes per session (this checkpoint, after {steps} decode steps):\n")
    print("| tokens | global KV | window rings | other | total | `session_bytes` formula |")
    print("|---|---|---|---|---|---|")
    picks = sorted(range(len(seq.caches)), key=lambda i: last["sessions"][i].length)
    for i in sorted(set(picks[::max(1, len(picks) // 4)] + picks[-1:]), key=picks.index):
        got, tokens = mlx_v41.cache_bytes(seq.caches[i]), seq.caches[i][0].offset
        print(f"| {tokens:,} | {got['global_kv']:,} | {got['window']:,} | {got['other']:,} | "
              f"{got['total']:,} | {session_bytes(cfg, tokens):,} |")
    alone = [mlx_v41.cache_bytes(c)["total"] for c in seq.caches]
    batched = [mlx_v41.cache_bytes(c)["total"] for c in last["batched"].caches]
    print(f"\n{len(alone)} sessions: sum alone {sum(alone):,} B; after batch_forward "
          f"{sum(batched):,} B (per session equal: {alone == batched})")
    if last["held"] and all(h is not None for h in last["held"]):
        held = [h["total"] for h in last["held"]]
        print(f"BatchGenerator holding the {len(held)} sessions at the same positions: "
              f"{sum(held):,} B (= sum alone: {sum(held) == sum(alone)}, per session equal: "
              f"{held == alone})")


# ------------------------------------------------------------------ a Mac, computed


def step_weight_parts(args: ModelArgs) -> tuple:
    """(bytes read once per step, routed-expert bytes per expert per layer summed over layers,
    embedding bytes per token) of the model as this package holds it (lazy: nothing
    allocated)."""
    from mlx_v41.model.model import Model

    cfg = args.text_config
    once = experts = embed = 0
    for name, value in tree_flatten(Model(args).parameters()):
        if "switch_mlp" in name:
            experts += value.nbytes / cfg.n_routed_experts
        elif name.startswith("model.embed_tokens"):
            embed += value.nbytes / cfg.vocab_size
        elif not (name.startswith("mtp") or name.startswith("dspark")):
            once += value.nbytes
    return once, experts, embed


def cache_read_bytes(cfg, context: int) -> float:
    """Cache rows one decode token reads at `context` (bench_real_width's arithmetic): the
    window's FP8 rows, top-k packed rows per global layer, every index key of an indexer."""
    roles = layer_roles(cfg)[:cfg.num_hidden_layers]
    window = cfg.num_hidden_layers * cfg.sliding_window * (cfg.head_dim + cfg.head_dim // 32)
    selected = sum(cfg.index_topk * (cfg.head_dim // 2 + cfg.head_dim // 16)
                   for r in roles if r.ratio > 0)
    index = sum((context // r.ratio) * (cfg.index_head_dim // 2 + cfg.index_head_dim // 32)
                for r in roles if r.has_indexer)
    return window + selected + index


def roofline(sizes: list, bandwidth: float, context: int) -> None:
    args = ModelArgs.from_file(official_config_path())
    cfg = args.text_config
    once, expert, embed = step_weight_parts(args)
    rows = cache_read_bytes(cfg, context)
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    print(f"\nA Mac at {bandwidth / 1e9:,.0f} GB/s, the official config, computed: weights read "
          f"once per step {once / 1e9:.2f} GB, one routed expert in every layer "
          f"{expert / 1e6:.1f} MB, cache rows per sequence at {context:,} tokens "
          f"{rows / 1e6:.1f} MB\n")
    print(f"| B | distinct experts per layer (of {e}) | weights per step | + cache rows | "
          "bytes per token | roofline tok/s | vs B = 1 |")
    print("|---|---|---|---|---|---|---|")
    base = None
    for b in sizes:
        distinct = e * (1 - (1 - k / e) ** b)
        weights = once + distinct * expert + b * embed
        total = weights + b * rows
        rate = b * bandwidth / total
        base = base or rate
        print(f"| {b} | {distinct:.1f} | {weights / 1e9:.2f} GB | {total / 1e9:.2f} GB | "
              f"{total / b / 1e9:.2f} GB | {rate:,.1f} | {rate / base:.2f}x |")


def sessions_that_fit(memory: int) -> None:
    args = ModelArgs.from_file(official_config_path())
    cfg = args.text_config
    resident, tables = weight_bytes(args)
    fixed = sum(fixed_cache_bytes(cfg).values())
    print(f"\nSessions in {memory / 2**30:,.0f} GiB, the official config (`mlx_v41.model.memory`): "
          f"global KV {global_bytes_per_token(cfg):g} B/token, constant per session "
          f"{fixed / 2**20:.2f} MiB, weights resident {resident / 2**30:.2f} GiB, Engram tables "
          f"memory-mapped {tables / 2**30:.2f} GiB\n")
    print("| context | one session | sessions beside the resident weights | "
          "... and the Engram tables held in memory too |")
    print("|---|---|---|---|")
    for text in CONTEXTS:
        one = session_bytes(cfg, parse_count(text))
        fits = [max(0, int((memory - used) // one)) for used in (resident, resident + tables)]
        print(f"| {text} ({parse_count(text):,}) | {one / 2**30:.3f} GiB | {fits[0]:,} | "
              f"{fits[1]:,} |")


# ------------------------------------------------------------------ main


def cpu_checkpoint(folder: Path, engram: bool, real: bool) -> Path:
    if (folder / "config.json").is_file():
        return folder
    start = time.perf_counter()
    if real:
        config = without_engram({**schedule_text_config(), **REAL})
    else:
        config = {**schedule_text_config(), **PUBLISHED_POOL, "vocab_size": VOCAB,
                  "sliding_window": 32, "index_topk": 128}
    write_checkpoint(folder, config, engram=engram and not real)
    print(f"checkpoint written in {time.perf_counter() - start:.0f} s", flush=True)
    return folder


def bench_cpu(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = mlx_v41.load_model(cpu_checkpoint(Path(tmp), args.engram, False))
        lengths = mixed_lengths(max(args.sizes), args.min_context, args.max_context)
        tic = time.perf_counter()
        sessions = prefill_sessions(model, lengths, args.prefill_step_size)
        print(f"{len(lengths)} contexts {min(lengths)}-{max(lengths)} prefilled in "
              f"{time.perf_counter() - tic:.0f} s; {args.steps} greedy steps per sequence; "
              f"Engram layers {model.cfg.engram_layer_ids}; DSpark drafter {model.drafting}",
              flush=True)
        result = speed(model, sessions, args.sizes, args.steps, args.repeats)
        speed_table(result["rows"])
        measured_memory(model, result["last"], args.steps)


def engine_steps(model, sessions: list, steps: int, pipelined: bool) -> dict:
    """`BatchGenerator.next()` over the sessions (all decoding from the first step): the
    median wall time of a step, and of its time outside `mx.eval` (the host's: building the
    graph, sampling, emitting) where each step is evaluated before it returns, plus the
    tokens."""
    engine = mlx_v41.BatchGenerator(model, max_tokens=steps + 2, pipelined=pipelined,
                                    completion_batch_size=len(sessions),
                                    prefill_batch_size=len(sessions))
    engine.insert([[s.first] for s in sessions],
                  caches=[mlx_v41.copy_cache(s.cache) for s in sessions])
    real_eval, waited = mx.eval, [0.0]

    def timed_eval(*arrays):
        tic = time.perf_counter()
        real_eval(*arrays)
        waited[0] += time.perf_counter() - tic

    walls, hosts, tokens = [], [], {}
    mx.eval = timed_eval
    try:
        engine.next()  # the one-token prompts and first samples
        while len(engine):
            waited[0], tic = 0.0, time.perf_counter()
            for r in engine.next():
                tokens.setdefault(r.uid, []).append(r.token)
            walls.append(time.perf_counter() - tic)
            hosts.append(walls[-1] - waited[0])
    finally:
        mx.eval = real_eval
    steady = slice(1, -1)  # the first and last steps start or drain the pipeline
    return dict(wall=float(np.median(walls[steady])), host=float(np.median(hosts[steady])),
                tokens=tokens)


def pipeline(model, sessions: list, sizes: list, steps: int, repeats: int) -> None:
    """The pipelined step against the step evaluated before it returns, per B."""
    print("\n| B | step, evaluated before it returns | its host time (outside mx.eval) | "
          "step, pipelined | pipelined / evaluated | share of the host time hidden | tokens |")
    print("|---|---|---|---|---|---|---|")
    for b in sizes:
        part = sessions[:b]
        engine_steps(model, part, 2, True)  # warm-up at this batch shape
        best = {}
        for _ in range(repeats):
            for pipelined in (False, True):
                run = engine_steps(model, part, steps, pipelined)
                if pipelined not in best or run["wall"] < best[pipelined]["wall"]:
                    best[pipelined] = run
        old, new = best[False], best[True]
        hidden = (old["wall"] - new["wall"]) / old["host"] if old["host"] > 0 else 0.0
        same = "identical" if old["tokens"] == new["tokens"] else "DIFFER"
        print(f"| {b} | {old['wall'] * 1e3:.1f} ms | {old['host'] * 1e3:.1f} ms | "
              f"{new['wall'] * 1e3:.1f} ms | {new['wall'] / old['wall']:.3f} | {hidden:.0%} | "
              f"{same} |", flush=True)


def bench_pipeline(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = mlx_v41.load_model(cpu_checkpoint(Path(tmp), args.engram, False))
        lengths = mixed_lengths(max(args.pipeline), args.min_context, args.max_context)
        sessions = prefill_sessions(model, lengths, args.prefill_step_size)
        pipeline(model, sessions, args.pipeline, args.steps, args.repeats)


def bench_real(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = mlx_v41.load_model(cpu_checkpoint(args.real_checkpoint or Path(tmp), False, True))
        lengths = mixed_lengths(max(args.real_sizes), *args.real_context)
        tic = time.perf_counter()
        sessions = prefill_sessions(model, lengths, args.prefill_step_size)
        print(f"real widths: {len(lengths)} contexts {min(lengths)}-{max(lengths)} prefilled in "
              f"{time.perf_counter() - tic:.0f} s", flush=True)
        rows = speed(model, sessions, args.real_sizes, args.real_steps, 1, engine=False)["rows"]
        speed_table(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--steps", type=int, default=12, help="greedy steps per sequence (>= 2)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per path; the fastest")
    parser.add_argument("--min-context", type=int, default=256)
    parser.add_argument("--max-context", type=int, default=4096)
    parser.add_argument("--prefill-step-size", type=int, default=512)
    parser.add_argument("--engram", action="store_true", help="keep Engram at layers 1 and 14")
    parser.add_argument("--real-width", action="store_true", help="also time the real widths")
    parser.add_argument("--real-sizes", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--real-steps", type=int, default=2)
    parser.add_argument("--real-context", type=int, nargs=2, default=[4, 16],
                        metavar=("MIN", "MAX"))
    parser.add_argument("--real-checkpoint", type=Path,
                        help="reuse (or write) the real-width checkpoint here (writing it takes "
                        "minutes)")
    parser.add_argument("--skip-cpu", action="store_true", help="no CPU-checkpoint speed run")
    parser.add_argument("--pipeline", type=int, nargs="+", metavar="B",
                        help="also time the pipelined engine step against the one evaluated "
                        "before it returns, at these B (e.g. 1 8 32)")
    parser.add_argument("--bandwidth", type=parse_bytes, default=parse_bytes("800GB"),
                        help="memory bandwidth per second for the roofline (default 800GB)")
    parser.add_argument("--roofline-context", type=parse_count, default=parse_count("128K"))
    parser.add_argument("--mac-memory", type=parse_bytes, default=parse_bytes("512GiB"))
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2")
    print(f"mlx {mx.__version__}, device {mx.default_device()}, load average "
          f"{os.getloadavg()[0]:.2f}")
    if not args.skip_cpu:
        bench_cpu(args)
    if args.pipeline:
        bench_pipeline(args)
    if args.real_width:
        bench_real(args)
    roofline(sorted(set(args.sizes) | {1, 8, 32, 64}), args.bandwidth, args.roofline_context)
    sessions_that_fit(args.mac_memory)
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
