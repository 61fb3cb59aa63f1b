"""Decode step time of a model with Engram (the tiny golden checkpoint: Engram at layers 1 and
5, memory-mapped tables) through the pipelined `generate_step`, where the next step's graph is
built while the current one computes. Run it on two commits to compare their Engram paths.

    python benchmarks/bench_decode_engram.py [--steps 64 --repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout too
import mlx_v41  # noqa: E402
from mlx_v41.generation.api import generate_step  # noqa: E402

CHECKPOINT = ROOT / "tests/data/goldens/tiny/hf"


def decode_seconds(model, prompt, steps: int) -> float:
    cache = model.make_cache()
    logits = model.prefill(prompt, cache)
    mx.eval(logits)
    tic = time.perf_counter()
    for _ in generate_step(model, logits, cache, max_tokens=steps):
        pass
    return (time.perf_counter() - tic) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model = mlx_v41.load_model(CHECKPOINT)
    prompt = mx.arange(3, 3 + args.prompt)[None] % model.cfg.vocab_size
    decode_seconds(model, prompt, 4)  # warm up (compiled functions, page cache)
    times = [decode_seconds(model, prompt, args.steps) for _ in range(args.repeats)]
    print(f"decode: median {1e3 * statistics.median(times):.2f} ms/step over {args.repeats} runs "
          f"of {args.steps} steps (min {1e3 * min(times):.2f}, max {1e3 * max(times):.2f})")


if __name__ == "__main__":
    main()
