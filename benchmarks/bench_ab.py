"""Prefill and decode speed of this checkout against another source tree of mlx_v41, in turn.

For a change that must not slow the model down: the other tree is an earlier commit unpacked
beside this one (`git archive <commit> | tar -x -C /tmp/base`). One random checkpoint in the
published layout (the one bench_vs_mlx_lm.py times: 40 + 3 layers at hidden 128, no Engram) is
written once; then each pair of runs times both trees, each in a fresh process that imports
mlx_v41 from its tree, the order alternating from pair to pair so that the machine's drift falls
on both alike. Prints every run, the medians and the ratio this / other.

With --batch B: instead, the batched decode step (`batch_forward`) of B sequences at contexts
spread over prompt / B .. prompt (snapshots of one prefill), `--decode` steps after one
warm-up step, in tokens/s of the whole batch.

    python -m benchmarks.bench_ab --other /tmp/base [--pairs 4 --prompt 1024 --decode 24]
    python -m benchmarks.bench_ab --other /tmp/base --batch 32 --decode 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def child(tree: Path, folder: Path, prompt: int, decode: int, step: int, batch: int) -> dict:
    """One timed run with mlx_v41 imported from `tree` (this process only)."""
    sys.path.insert(0, str(tree))
    import mlx.core as mx

    import mlx_v41

    assert Path(mlx_v41.__file__).resolve().is_relative_to(tree.resolve()), mlx_v41.__file__
    model = mlx_v41.load_model(folder)
    rng = np.random.default_rng(0)
    ids = mx.array(rng.integers(3, model.cfg.vocab_size, (1, prompt)), dtype=mx.int32)
    tokens = mx.array(rng.integers(3, model.cfg.vocab_size, decode), dtype=mx.int32)

    # after mlx_v41 is imported, so the path this module adds does not change which one
    from benchmarks.bench_vs_mlx_lm import decode as decode_steps, prefill as prefill_chunks

    def call(x, cache):
        return model(x, cache=cache, last_only=True)

    if batch:
        return {"batch decode": batched(model, call, ids, decode, batch)}

    def run(ids, tokens):
        start = time.perf_counter()
        cache = prefill_chunks(call, model.make_cache, ids, step)
        middle = time.perf_counter()
        decode_steps(call, cache, tokens)
        return middle - start, time.perf_counter() - middle

    run(ids[:, :64], tokens[:4])  # warm-up
    prefill_s, decode_s = run(ids, tokens)
    return {"prefill": prompt / prefill_s, "decode": decode / decode_s}


def batched(model, call, ids, steps: int, batch: int) -> float:
    """Tokens/s of `steps` batched decode steps of `batch` sequences at contexts prompt / batch
    .. prompt (snapshots of one prefill, read in `batch` chunks), after one warm-up step."""
    import mlx.core as mx

    import mlx_v41
    from mlx_v41.model.batch import batch_forward

    cache, caches = model.make_cache(), []
    for chunk in mx.split(ids, batch, axis=1):
        mx.eval(call(chunk, cache))
        caches.append(mlx_v41.copy_cache(cache))
    tokens = mx.array(np.random.default_rng(1).integers(3, model.cfg.vocab_size,
                                                        (steps + 1, batch, 1)), dtype=mx.int32)

    def step(t):
        mx.eval(batch_forward(model, tokens[t], caches).logits,
                [c.state for one in caches for c in one])

    step(0)
    start = time.perf_counter()
    for t in range(1, steps + 1):
        step(t)
    return steps * batch / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--other", type=Path, required=True, help="the other source tree")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--decode", type=int, default=24)
    parser.add_argument("--prefill-step-size", type=int, default=512)
    parser.add_argument("--checkpoint", type=Path, help="reuse (or write) the checkpoint here")
    parser.add_argument("--batch", type=int, default=0,
                        help="time the batched decode step of this many sequences instead")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.checkpoint, args.prompt, args.decode,
                               args.prefill_step_size, args.batch)))
        return
    if not (args.other / "mlx_v41" / "__init__.py").is_file():
        parser.error(f"--other {args.other}: no mlx_v41 package there")
    folder = args.checkpoint or Path(tempfile.mkdtemp()) / "ckpt"
    if not (folder / "config.json").is_file():
        from benchmarks.bench_vs_mlx_lm import (PUBLISHED_POOL, VOCAB, schedule_text_config,
                                                write_checkpoint)
        config = {**schedule_text_config(), **PUBLISHED_POOL, "vocab_size": VOCAB,
                  "sliding_window": 32, "index_topk": 128}
        write_checkpoint(folder, config, engram=False)
    trees = {"this": ROOT, "other": args.other.resolve()}
    runs: dict = {name: [] for name in trees}
    for pair in range(args.pairs):
        order = list(trees) if pair % 2 == 0 else list(trees)[::-1]
        for name in order:
            command = [sys.executable, "-m", "benchmarks.bench_ab", "--other", str(args.other),
                       "--child", str(trees[name]), "--checkpoint", str(folder),
                       "--prompt", str(args.prompt), "--decode", str(args.decode),
                       "--prefill-step-size", str(args.prefill_step_size),
                       "--batch", str(args.batch)]
            out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                                 env={**os.environ, "PYTHONPATH": str(trees[name])})
            if out.returncode:
                sys.exit(f"{name} run failed:\n{out.stderr[-2000:]}")
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"pair {pair + 1} {name:5s} {rates(runs[name][-1])}", flush=True)
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
               for name, rs in runs.items()}
    for name, m in medians.items():
        print(f"median {name:5s} {rates(m)}")
    print("this / other: " + "  ".join(f"{k} {medians['this'][k] / medians['other'][k]:.3f}x"
                                       for k in medians["this"]))


def rates(run: dict) -> str:
    return "  ".join(f"{k} {v:7.2f} tok/s" for k, v in run.items())


if __name__ == "__main__":
    main()
