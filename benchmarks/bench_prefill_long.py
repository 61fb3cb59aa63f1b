"""Long prefills at the real index width: time and peak memory, ours vs mlx-lm, one run per length.

The published 40 + 3 layer schedule at hidden 128 (tests/checkpoint_factory.py, no Engram) with
the real `index_n_heads` 32 (index_head_dim 64 at this width) and index top-k 512, window 128:
the indexer scores every query row against all of its owner's compressed rows, so at long
contexts it is what a prefill costs, and how its blocks are evaluated decides the memory.
Random prompt, chunks of --step, each chunk's cache evaluated (as mlx-lm's generate does);
`mx.get_peak_memory()` after `mx.reset_peak_memory()`, weights included. Both models run one
after the other within the run of a length; mlx-lm only up to --mlx-lm-max tokens (its
quadratic prefill takes hours beyond that on a small CPU).

    python -m benchmarks.bench_prefill_long [--lengths 8192 32768 131072 --mlx-lm-max 8192]
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # run from a checkout; the factory is a test helper

from benchmarks.bench_vs_mlx_lm import PUBLISHED_POOL, load_mlx_lm, load_ours, prefill  # noqa: E402
from checkpoint_factory import schedule_text_config, write_checkpoint  # noqa: E402

REAL_INDEX = dict(index_n_heads=32, index_topk=512, sliding_window=128, vocab_size=8192)


def run(name: str, load, ids: mx.array, step: int) -> tuple:
    """(seconds, peak MiB) of one prefill of `ids`."""
    call, make_cache = load()
    gc.collect()
    mx.reset_peak_memory()
    start = time.perf_counter()
    prefill(call, make_cache, ids, step)
    seconds, peak = time.perf_counter() - start, mx.get_peak_memory() / 2**20
    print(f"  {name:8s} {ids.shape[1]:7d} tokens: {seconds:8.1f} s, "
          f"{ids.shape[1] / seconds:7.1f} tok/s, peak {peak:8.1f} MiB", flush=True)
    return seconds, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--mlx-lm-max", type=int, default=8192,
                        help="longest prompt mlx-lm is run on")
    parser.add_argument("--step", type=int, default=512, help="prefill chunk")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_checkpoint(folder, {**schedule_text_config(), **PUBLISHED_POOL, **REAL_INDEX},
                         engram=False)
        print(f"40 + 3 layers, hidden 128, {REAL_INDEX}, chunks of {args.step}; "
              f"mlx {mx.__version__}")
        rng = np.random.default_rng(0)
        for length in args.lengths:
            ids = mx.array(rng.integers(3, REAL_INDEX["vocab_size"], (1, length)),
                           dtype=mx.int32)
            ours = run("mlx_v41", lambda: load_ours(folder), ids, args.step)
            if length <= args.mlx_lm_max:
                theirs = run("mlx-lm", lambda: load_mlx_lm(folder), ids, args.step)
                print(f"  ratio: {theirs[0] / ours[0]:.2f}x faster, "
                      f"{theirs[1] / ours[1]:.2f}x less peak memory", flush=True)


if __name__ == "__main__":
    main()
