"""Stall-free batching: replies' token gaps while a long prompt is read, a short request's
time to first token behind it, and the long prompt's prefill time, for the old schedule
(`decode_prefill_budget=None`: `prefill_step_size` chunks, the CED halo in one piece) against
the paced one (the default "auto" budget, or --budget tokens), its pieces between the decode
steps or on the prompt thread (`prefill_thread=True`), in the same run.

Per schedule, on one `BatchGenerator` (--prefill-step-size, greedy, no stop tokens): --decoders
random prompts of 16-64 tokens are read and decode --before steps alone (the token gaps
"before"); then a random prompt of --long-tokens arrives, and --short-after steps later a
prompt of --short-tokens. Stepping goes on until the long prompt's first token. A reply's gap
is the time between two of its tokens (each step emits one token per decoding reply): p50 /
p99 over all replies, before and while the long prompt is read. The short request's time to
first token counts the steps (and seconds) from its insert to its first token, its prefill
included. The long prompt's prefill time is its insert to its first token; "prompt seconds"
is the part of it the generator spent reading prompts. Then the long and short prompts are
dropped and the replies decode --after steps alone again: the decode step (p50 and its own p99)
at the contexts the replies have reached by then. --idle also times a batch-1
`Model.prefill` of the long prompt with nothing decoding. "Cores busy" is the process's CPU
seconds per wall second, decoding alone and while the long prompt is read (and in the idle
prefill): what the work asks of the machine. The schedules' tokens must be identical (both are
exact per sequence).

Model: the tiny golden checkpoint (12 layers, window 16; the drafter left out unless
--dspark), or --model PATH.

    python benchmarks/bench_stall.py [--long-tokens 16384 --decoders 8 --budget auto
        --min-chunk 32 --idle --thread-piece 256]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout too

import mlx_v41  # noqa: E402
from mlx_v41.generation import prompt_schedule  # noqa: E402
from mlx_v41.generation.batch import MIN_PREFILL_CHUNK, BatchGenerator  # noqa: E402

CHECKPOINT = ROOT / "tests/data/goldens/tiny/hf"


@dataclass
class Result:
    """One schedule's run."""

    name: str
    gaps_before: list = field(default_factory=list)  # s between a reply's tokens
    gaps_during: list = field(default_factory=list)
    step_before: float = 0.0  # median step time with only decoding
    step_after: float = 0.0  # the same after the long prompt, at the contexts reached then
    step_after_p99: float = 0.0
    cores_before: float = 0.0  # the process's CPU seconds per wall second, only decoding
    cores_during: float = 0.0  # the same while the long prompt is read
    short_steps: int = 0
    short_seconds: float = 0.0
    long_seconds: float = 0.0
    prompt_seconds: float = 0.0  # of long_seconds, reading prompts
    steps: int = 0  # while the long prompt was read
    budgets: list = field(default_factory=list)
    decode_during: list = field(default_factory=list)  # each step's decode part (s)
    prompt_during: list = field(default_factory=list)  # each step's prompt part (s)
    tokens: dict = field(default_factory=dict)  # reply index -> token ids


def make_prompts(model, args, seed: int = 0) -> tuple:
    """(the replies' prompts, the long prompt, the short one): random ids below the vocabulary's
    last 16 (where special tokens sit)."""
    rng = np.random.default_rng(seed)
    top = max(4, model.cfg.vocab_size - 16)
    decoders = [rng.integers(3, top, int(n)).tolist()
                for n in rng.integers(16, 65, args.decoders)]
    return (decoders, rng.integers(3, top, args.long_tokens).tolist(),
            rng.integers(3, top, args.short_tokens).tolist())


def run(model, name: str, budget, args, thread: bool = False) -> Result:
    decoders, long_ids, short_ids = make_prompts(model, args)
    generator = BatchGenerator(model, stop_tokens=(), max_tokens=1 << 30,
                               completion_batch_size=args.decoders + 2,
                               prefill_step_size=args.prefill_step_size,
                               decode_prefill_budget=budget,
                               min_prefill_chunk=args.min_chunk, prefill_thread=thread)
    result, times = Result(name), {}
    uids = generator.insert(decoders)
    index = {uid: i for i, uid in enumerate(uids)}

    def step() -> list:
        responses = generator.next()
        now = time.perf_counter()
        for r in responses:
            times.setdefault(r.uid, []).append(now)
            if r.uid in index:
                result.tokens.setdefault(index[r.uid], []).append(r.token)
        return responses

    while len(generator.decoding) < len(uids):
        step()
    for _ in range(2):  # warm-up at this batch shape
        step()
    def timed(n: int) -> list:
        """Each of `n` steps' seconds."""
        out = []
        for _ in range(n):
            tic = time.perf_counter()
            step()
            out.append(time.perf_counter() - tic)
        return out

    start, cpu = time.perf_counter(), time.process_time()
    result.step_before = percentile(timed(args.before), 50)
    result.cores_before = (time.process_time() - cpu) / (time.perf_counter() - start)
    result.gaps_before = gaps(times, uids, start, time.perf_counter())
    prompt_time = generator.counters.prompt_time
    inserted, cpu = time.perf_counter(), time.process_time()
    long_uid = generator.insert([long_ids])[0]
    short_uid, short_at = None, None
    while long_uid not in times:
        if result.steps == args.short_after:
            short_uid, short_at = generator.insert([short_ids], max_tokens=1)[0], result.steps
            short_time = time.perf_counter()
        counters = generator.counters
        decode_time, prompt_time_before = counters.generation_time, counters.prompt_time
        responses = step()
        result.steps += 1
        result.budgets.append(generator.step_budget)
        result.decode_during.append(counters.generation_time - decode_time)
        result.prompt_during.append(counters.prompt_time - prompt_time_before)
        if short_uid is not None and not result.short_steps and \
                any(r.uid == short_uid for r in responses):
            result.short_steps = result.steps - short_at
            result.short_seconds = times[short_uid][0] - short_time
        if result.steps % 200 == 0:
            print(f"    {name}: step {result.steps}, {time.perf_counter() - inserted:.0f} s",
                  flush=True)
    result.long_seconds = times[long_uid][0] - inserted
    result.cores_during = (time.process_time() - cpu) / (time.perf_counter() - inserted)
    result.prompt_seconds = generator.counters.prompt_time - prompt_time
    result.gaps_during = gaps(times, uids, inserted, times[long_uid][0])
    # The replies alone again (the long and short prompts dropped), at the contexts they have
    # reached: the decode step alone after, its median and its own p99.
    generator.remove([long_uid, short_uid])
    for _ in range(2):
        step()
    after = timed(args.after)
    result.step_after, result.step_after_p99 = percentile(after, 50), percentile(after, 99)
    generator.remove([s.uid for s in generator.sequences])
    generator.close()
    return result


def gaps(times: dict, uids: list, begin: float, end: float) -> list:
    """Every reply's gaps between two tokens emitted within [begin, end]."""
    out = []
    for uid in uids:
        stamps = [t for t in times.get(uid, []) if begin <= t <= end]
        out += np.diff(stamps).tolist()
    return out


def idle_prefill(model, args) -> tuple:
    """(seconds, the process's CPU seconds per wall second) of a batch-1 prefill of the long
    prompt with nothing else running."""
    ids = mx.array([make_prompts(model, args)[1]])
    tic, cpu = time.perf_counter(), time.process_time()
    mx.eval(model.prefill(ids, model.make_cache(), step_size=args.prefill_step_size))
    seconds = time.perf_counter() - tic
    return seconds, (time.process_time() - cpu) / seconds


def percentile(values: list, q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def report(results: list, idle) -> None:
    old = results[0]
    print("\n| schedule | decode step alone | gaps before p50 / p99 | gaps while the long "
          "prompt is read p50 / p99 | p99 / decode step | short request: first token "
          "| long prompt: first token (prompt seconds) | steps | budget (tokens) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        budgets = [b for b in r.budgets if b != float("inf")]
        budget = f"{min(budgets):.0f}-{max(budgets):.0f}" if budgets else "-"
        print(f"| {r.name} | {r.step_before * 1e3:.0f} ms | "
              f"{percentile(r.gaps_before, 50) * 1e3:.0f} / "
              f"{percentile(r.gaps_before, 99) * 1e3:.0f} ms | "
              f"{percentile(r.gaps_during, 50) * 1e3:.0f} / "
              f"{percentile(r.gaps_during, 99) * 1e3:.0f} ms | "
              f"{percentile(r.gaps_during, 99) / r.step_before:.1f}x | "
              f"{r.short_steps} steps, {r.short_seconds:.2f} s | "
              f"{r.long_seconds:.1f} s ({r.prompt_seconds:.1f} s) | {r.steps} | {budget} |")
    print("\nwhile the long prompt is read, per step (ms): decode part p50 / p99, prompt part "
          "p50 / p99; the gap p99 over the decode part's p50 (the decode step alone then)")
    for r in results:
        print(f"  {r.name}: decode {percentile(r.decode_during, 50) * 1e3:.0f} / "
              f"{percentile(r.decode_during, 99) * 1e3:.0f}, prompt "
              f"{percentile(r.prompt_during, 50) * 1e3:.0f} / "
              f"{percentile(r.prompt_during, 99) * 1e3:.0f}; gap p99 "
              f"{percentile(r.gaps_during, 99) / percentile(r.decode_during, 50):.1f}x")
    print("\nthe replies decoding alone again after the long prompt (--after steps, the contexts "
          "they reached): decode step p50 / p99; the gap p99 while the long prompt was read "
          "over that p50")
    for r in results:
        print(f"  {r.name}: {r.step_after * 1e3:.0f} / {r.step_after_p99 * 1e3:.0f} ms; gap p99 "
              f"{percentile(r.gaps_during, 99) / r.step_after:.1f}x")
    for new in results[1:]:
        short = f"{new.short_seconds / old.short_seconds:.3f}x" if old.short_seconds else \
            "- (it came after the long prompt's first token)"
        print(f"\n{new.name} / {old.name}: gap p99 "
              f"{percentile(new.gaps_during, 99) / percentile(old.gaps_during, 99):.3f}x, "
              f"short request first token {short}, long "
              f"prompt first token {new.long_seconds / old.long_seconds:.3f}x (prompt seconds "
              f"{new.prompt_seconds / old.prompt_seconds:.3f}x)")
    print("\ncores busy (the process's CPU seconds per wall second): "
          + "; ".join(f"{r.name}: {r.cores_before:.2f} only decoding, {r.cores_during:.2f} "
                      f"while the long prompt is read" for r in results))
    if idle is not None:
        idle, cores = idle
        print(f"idle batch-1 prefill of the long prompt: {idle:.1f} s ({cores:.2f} cores busy)")
        for r in results:
            print(f"  {r.name}: long prompt first token / idle {r.long_seconds / idle:.3f}x, "
                  f"prompt seconds / idle {r.prompt_seconds / idle:.3f}x")
    same = all(old.tokens[i][:n] == new.tokens[i][:n] for new in results[1:]
               for i in old.tokens for n in [min(len(old.tokens[i]), len(new.tokens[i]))])
    print(f"replies' tokens identical across the schedules: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=CHECKPOINT)
    parser.add_argument("--dspark", action="store_true", help="load the DSpark drafter too")
    parser.add_argument("--long-tokens", type=int, default=16384,
                        help="the long prompt (32768 takes about 10 minutes on 2 CPU cores)")
    parser.add_argument("--short-tokens", type=int, default=10)
    parser.add_argument("--short-after", type=int, default=2,
                        help="steps after the long prompt's arrival the short one arrives")
    parser.add_argument("--decoders", type=int, default=8)
    parser.add_argument("--before", type=int, default=16, help="decode steps before")
    parser.add_argument("--after", type=int, default=100,
                        help="decode steps alone after the long prompt's first token")
    parser.add_argument("--prefill-step-size", type=int, default=2048)
    parser.add_argument("--budget", default="auto",
                        help="the paced schedule's decode_prefill_budget: auto or tokens")
    parser.add_argument("--min-chunk", type=int, default=MIN_PREFILL_CHUNK,
                        help="the paced schedule's min_prefill_chunk")
    parser.add_argument("--schedules", default="old,paced,thread",
                        help="which to run, in order (the first is the baseline): old (one "
                        "chunk a step), paced (the budget, pieces between decode steps), "
                        "thread (the budget, pieces on the prompt thread)")
    parser.add_argument("--idle", action="store_true",
                        help="also time a batch-1 prefill of the long prompt alone")
    parser.add_argument("--thread-piece", type=int, default=prompt_schedule.THREAD_PIECE,
                        help="the thread schedule's piece while replies decode (tokens)")
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="sys.setswitchinterval for the run (seconds; Python's is 0.005)")
    args = parser.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    prompt_schedule.THREAD_PIECE = args.thread_piece
    budget = args.budget if args.budget == "auto" else int(args.budget)
    model = mlx_v41.load_model(args.model, dspark=args.dspark)
    print(f"mlx {mx.__version__}, device {mx.default_device()}, switch interval "
          f"{sys.getswitchinterval() * 1e3:g} ms, load average "
          f"{os.getloadavg()[0]:.2f}; {args.model.name if args.model != CHECKPOINT else 'tiny'}"
          f" ({model.cfg.num_hidden_layers} layers, decoder from "
          f"{model.model.decoder_start}, prefill {model.prefill_mode}); {args.decoders} "
          f"replies decoding, a {args.long_tokens:,}-token prompt, then a "
          f"{args.short_tokens}-token one; chunks of {args.prefill_step_size}", flush=True)
    results = []
    schedules = {"old": ("old", None, False), "paced": (f"paced ({args.budget})", budget, False),
                 "thread": (f"thread ({args.budget})", budget, True)}
    for key in args.schedules.split(","):
        name, value, thread = schedules[key]
        tic = time.perf_counter()
        results.append(run(model, name, value, args, thread))
        print(f"  {name}: {time.perf_counter() - tic:.0f} s", flush=True)
    idle = idle_prefill(model, args) if args.idle else None
    report(results, idle)
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
