"""Prefill and decode speed of mlx_v41 against mlx-lm's `deepseek_v41` port on one random
checkpoint.

One run writes a random checkpoint in the published layout (tests/checkpoint_factory.py): the
published 40 + 3 layer schedule at the reference goldens' widths (hidden 128, 4 heads of 64,
6 experts, 3 per token), a vocabulary of 8192 and no Engram (mlx-lm refuses Engram). Window and
index top-k default to 32 / 128 rather than the published 128 / 512, so that a 2048-token prompt
is, as a long prompt is for the real model, mostly outside the window and top-k: the published
sizes (--window 128 --index-topk 512) cost ~4x more per token on a slow CPU. The models are
loaded side by side and warmed up, then timed in turn within each repeat (so load from other
processes falls on all alike): prefill in chunks of --prefill-step-size (every chunk's logits and
cache evaluated, as mlx-lm's generate does), then --decode single-token steps. Reports the median
of --repeats runs, the ratios ours / mlx-lm, each model's resident weight memory and its peak
working memory (peak above what was resident before the run). mlx_v41 runs its default exact CED
prefill (decoder layers skip rows no later window or logit reads); --also-full adds a run with
prefill_mode="full", the same work as mlx-lm; --also-mlx-sinkhorn adds a run with the decode
Sinkhorn in MLX instead of NumPy (`Kernels.host_sinkhorn=False`, the same bits).

    python benchmarks/bench_vs_mlx_lm.py [--prompt 2048 --decode 32 --prefill-step-size 512]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # run from a checkout; the factory is a test helper

from checkpoint_factory import schedule_text_config, write_checkpoint  # noqa: E402

VOCAB = 8192
PUBLISHED_POOL = dict(candidate_topk_blocks=2048, candidate_block_size=8)


def cache_arrays(obj, seen=None) -> list:
    """Every mx.array held by a cache (any object graph), to evaluate the cache state."""
    seen = set() if seen is None else seen
    if isinstance(obj, mx.array):
        return [obj]
    if id(obj) in seen or isinstance(obj, (str, int, float, bool, type(None), np.ndarray)):
        return []
    seen.add(id(obj))
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(
        obj, (list, tuple)) else vars(obj).values() if hasattr(obj, "__dict__") else []
    return [a for item in items for a in cache_arrays(item, seen)]


def prefill(call, make_cache, ids, step):
    cache = make_cache()
    for start in range(0, ids.shape[1], step):
        logits = call(ids[:, start:start + step], cache)
        mx.eval(logits, cache_arrays(cache))
    return cache


def decode(call, cache, tokens):
    for token in tokens:
        mx.eval(call(token.reshape(1, 1), cache))


class Runner:
    """One loaded model: its call, cache factory, resident weight bytes and timings."""

    def __init__(self, name, load):
        before = mx.get_active_memory()
        self.call, self.make_cache = load()
        self.weights_gb = (mx.get_active_memory() - before) / 1e9
        self.name, self.prefill_s, self.decode_s, self.peak_gb = name, [], [], 0.0

    def run(self, ids, tokens, step):
        """Timed prefill then decode; peak memory above what was resident before."""
        gc.collect()
        resident = mx.get_active_memory()
        mx.reset_peak_memory()
        start = time.perf_counter()
        cache = prefill(self.call, self.make_cache, ids, step)
        self.prefill_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        decode(self.call, cache, tokens)
        self.decode_s.append(time.perf_counter() - start)
        self.peak_gb = max(self.peak_gb, (mx.get_peak_memory() - resident) / 1e9)

    def summary(self, args) -> dict:
        return {"prefill": args.prompt / statistics.median(self.prefill_s),
                "decode": args.decode / statistics.median(self.decode_s),
                "peak_gb": self.peak_gb}


def load_ours(folder, prefill_mode="ced", host_sinkhorn=True):
    import mlx_v41

    model = mlx_v41.load_model(folder, prefill_mode=prefill_mode)
    model.kernels.host_sinkhorn = host_sinkhorn
    return lambda x, c: model(x, cache=c, last_only=True), model.make_cache


def load_mlx_lm(folder):
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(folder))
    return lambda x, c: model(x, cache=c)[:, -1:], model.make_cache


def bench(runners, args):
    """Warm each model up, then time them in turn within every repeat, so that load from
    other processes on the machine falls on all of them alike."""
    rng = np.random.default_rng(0)
    ids = mx.array(rng.integers(3, VOCAB, (1, args.prompt)), dtype=mx.int32)
    tokens = mx.array(rng.integers(3, VOCAB, args.decode), dtype=mx.int32)
    for r in runners:
        decode(r.call, prefill(r.call, r.make_cache, ids[:, :64], args.prefill_step_size),
               tokens[:4])
    for repeat in range(args.repeats):
        for r in runners:
            r.run(ids, tokens, args.prefill_step_size)
            print(f"  repeat {repeat + 1} {r.name:14s} prefill {r.prefill_s[-1]:6.1f} s, decode "
                  f"{r.decode_s[-1]:5.1f} s", flush=True)
    results = {}
    for r in runners:
        results[r.name] = res = r.summary(args)
        print(f"{r.name:14s} prefill {res['prefill']:7.1f} tok/s   decode {res['decode']:5.2f} "
              f"tok/s   weights {r.weights_gb:.3f} GB   peak working memory "
              f"{res['peak_gb']:.3f} GB", flush=True)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--decode", type=int, default=32, help="decode steps")
    parser.add_argument("--prefill-step-size", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--window", type=int, default=32, help="sliding_window (published 128)")
    parser.add_argument("--index-topk", type=int, default=128, help="index_topk (published 512)")
    parser.add_argument("--also-full", action="store_true",
                        help="also time mlx_v41 with prefill_mode='full'")
    parser.add_argument("--also-mlx-sinkhorn", action="store_true",
                        help="also time mlx_v41 with its decode Sinkhorn in MLX "
                             "(Kernels.host_sinkhorn=False) instead of NumPy")
    parser.add_argument("--checkpoint", type=Path, help="reuse (or write) the checkpoint here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.checkpoint or Path(tmp)
        if not (folder / "config.json").is_file():
            start = time.perf_counter()
            config = {**schedule_text_config(), **PUBLISHED_POOL, "vocab_size": VOCAB,
                      "sliding_window": args.window, "index_topk": args.index_topk}
            write_checkpoint(folder, config, engram=False)
            print(f"checkpoint written in {time.perf_counter() - start:.1f} s: {folder}")
        print(f"prompt {args.prompt}, prefill step {args.prefill_step_size}, decode "
              f"{args.decode}, median of {args.repeats}; mlx {mx.__version__}, "
              f"device {mx.default_device()}")
        runners = [Runner("mlx_v41", lambda: load_ours(folder))]
        if args.also_full:
            runners.append(Runner("mlx_v41 (full)", lambda: load_ours(folder, "full")))
        if args.also_mlx_sinkhorn:
            runners.append(Runner("mlx_v41 (MLX Sinkhorn)",
                                  lambda: load_ours(folder, host_sinkhorn=False)))
        runners.append(Runner("mlx-lm", lambda: load_mlx_lm(folder)))
        results = bench(runners, args)
    theirs = results.pop("mlx-lm")
    for name, ours in results.items():
        print(f"ratio {name} / mlx-lm: prefill {ours['prefill'] / theirs['prefill']:.2f}x, "
              f"decode {ours['decode'] / theirs['decode']:.2f}x, "
              f"peak working memory {ours['peak_gb'] / theirs['peak_gb']:.2f}x")


if __name__ == "__main__":
    main()
