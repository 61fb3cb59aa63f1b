"""What a second thread costs the decode step on MLX's CPU backend: the batched decode step of
--decoders replies, timed alone and then while another thread keeps busy (`prefill_thread`'s
situation), one contender at a time:

* `python`: a pure-Python loop (it holds the GIL between the interpreter's switches);
* `matmul`: 512 x 512 matmuls on a stream of its own (few, long operations);
* `small`: chains of 2,000 small matmuls on a stream of its own (many short operations);
* `pieces N`: prompt pieces of N tokens of a long prompt, on a stream of its own, read into a
  cache of a second copy of the model (so nothing but the process is shared), as one
  evaluation per mHC side and then in short evaluations (`kernels.context.short_evaluations`,
  as the prompt thread reads them).

MLX counts the tasks in flight (groups of 10 CPU dispatches) over all streams together, and an
evaluation that finds more than 10 waits for one to end after each of its dispatches
(`MAX_ACTIVE_TASKS` in mlx/transforms.cpp). So a thread whose evaluation keeps many tasks
queued makes every dispatch of the other wait for one of its tasks, however many cores are
free; short evaluations keep few of them in flight. Prints ms per decode step (median) and
the ratio to the step alone, and first what short evaluations cost a piece read alone.

    python benchmarks/bench_streams.py [--decoders 8 --pieces 32 256 --steps 15 --context 4096
        --only-short --switch-interval 0.005]
"""

from __future__ import annotations

import argparse
import contextlib
import queue
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout too

import mlx_v41  # noqa: E402
from mlx_v41.cache import copy_cache  # noqa: E402
from mlx_v41.generation.batch import BatchGenerator  # noqa: E402
from mlx_v41.kernels.context import short_evaluations  # noqa: E402

CHECKPOINT = ROOT / "tests/data/goldens/tiny/hf"


def python_loop(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(1000))


def matmuls(stop: threading.Event, chain: int, rows: int) -> None:
    a = mx.random.normal((512, 512))
    while not stop.is_set():
        y = mx.random.normal((rows, 512))
        for _ in range(chain):
            y = y @ a
        mx.eval(y)


def pieces(stop: threading.Event, model, context: list, size: int, vocab_top: int,
           short: bool) -> None:
    """Pieces of `size` random tokens read after `context` (a cache read once, copied)."""
    if short:
        with short_evaluations():
            return pieces(stop, model, context, size, vocab_top, False)
    ids = np.random.default_rng(1).integers(3, vocab_top, 64 * size).tolist()
    cache, at = copy_cache(context), 0
    while not stop.is_set() and at + size <= len(ids):
        mx.eval(model.prefill(mx.array([ids[at:at + size]]), cache))
        at += size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=CHECKPOINT)
    parser.add_argument("--decoders", type=int, default=8)
    parser.add_argument("--pieces", type=int, nargs="*", default=[32, 256])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--context", type=int, default=4096,
                        help="tokens read before the pieces (their attention's reach)")
    parser.add_argument("--only-short", action="store_true",
                        help="time the pieces in short evaluations only")
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="sys.setswitchinterval for the run (seconds; Python's is 0.005)")
    args = parser.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)

    model = mlx_v41.load(args.model, dspark=False)[0]
    other = mlx_v41.load(args.model, dspark=False)[0]
    top = max(4, model.cfg.vocab_size - 16)
    rng = np.random.default_rng(0)
    generator = BatchGenerator(model, stop_tokens=(), max_tokens=1 << 30,
                               completion_batch_size=args.decoders)
    generator.insert([rng.integers(3, top, 40).tolist() for _ in range(args.decoders)])
    for _ in range(12):  # prompts in, windows filling, shapes warm
        generator.next()

    def step_ms() -> float:
        times = []
        for _ in range(args.steps):
            tic = time.perf_counter()
            generator.next()
            times.append(time.perf_counter() - tic)
        return float(np.median(times)) * 1e3

    contenders = [] if args.only_short else [
                  ("python loop (GIL)", python_loop),
                  ("matmuls 512 x 512, chains of 10", lambda stop: matmuls(stop, 10, 512)),
                  ("small matmuls, chains of 2,000", lambda stop: matmuls(stop, 2000, 8))]
    context = other.make_cache()  # read alone, once; each contender reads after a copy
    mx.eval(other.prefill(mx.array([rng.integers(3, top, args.context).tolist()]), context),
            [c.state for c in context])
    contenders += [(f"prompt pieces of {n} tokens{', short evaluations' if short else ''}",
                    lambda stop, n=n, short=short: pieces(stop, other, context, n, top, short))
                   for short in ((True,) if args.only_short else (False, True))
                   for n in args.pieces]
    print(f"mlx {mx.__version__}, {mx.default_device()}; {args.decoders} replies decoding, "
          f"median of {args.steps} steps; pieces after {args.context} tokens")
    alone_table(other, context, args.pieces, top)
    print("| beside the decode step | ms per step | / alone |\n|---|---|---|")
    alone = step_ms()
    print(f"| nothing | {alone:.0f} | 1.00x |", flush=True)
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=contend, args=(jobs,), daemon=True).start()
    for name, fn in contenders:
        stop, done = threading.Event(), threading.Event()
        jobs.put((fn, stop, done))
        time.sleep(3.0)  # the contender under way
        ms = step_ms()
        stop.set()
        done.wait()
        print(f"| {name} | {ms:.0f} | {ms / alone:.2f}x |", flush=True)
    generator.close()


def alone_table(model, context: list, sizes: list, vocab_top: int) -> None:
    """What short evaluations cost a piece read with nothing beside it: ms per piece (median
    of 4, after one warm-up), each size read after `context` both ways."""
    print("\n| piece, read alone | one evaluation per mHC side | short evaluations |\n"
          "|---|---|---|")
    ids = np.random.default_rng(2).integers(3, vocab_top, 5 * max(sizes)).tolist()
    for size in sizes:
        times = {}
        for short in (False, True):
            cache, spent = copy_cache(context), []
            for at in range(0, 5 * size, size):
                tic = time.perf_counter()
                with short_evaluations() if short else contextlib.nullcontext():
                    mx.eval(model.prefill(mx.array([ids[at:at + size]]), cache))
                spent.append(time.perf_counter() - tic)
            times[short] = float(np.median(spent[1:])) * 1e3
        print(f"| {size} tokens | {times[False]:.0f} ms | {times[True]:.0f} ms "
              f"({times[True] / times[False]:.2f}x) |", flush=True)
    print()


def contend(jobs: queue.SimpleQueue) -> None:
    """The second thread, with its own stream, kept to the end of the process (MLX can abort
    at exit over the stream of a thread that has ended)."""
    with mx.stream(mx.new_stream(mx.default_device())):
        while True:
            fn, stop, done = jobs.get()
            fn(stop)
            done.set()


if __name__ == "__main__":
    main()
