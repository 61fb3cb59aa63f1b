"""Cache bytes per token and exact CED prefill vs full prefill, against mlx-lm's deepseek_v41.

1. Global KV bytes per token at the real head widths (head_dim 512, index_head_dim 128, owner
   layers 2/8/14/20) on a model that is small otherwise: ours measured with
   `mlx_v41.cache_bytes`, mlx-lm's from its cache arrays after the same prompt.
2. Prefill tokens/s of our exact CED prefill vs our full prefill vs mlx-lm, on the published
   40 + 3 layer schedule at small width, with a prompt of at least 8x the CED halo.

    python benchmarks/bench_cache.py [--window 8 --prompt-halos 8]
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
import mlx_v41  # noqa: E402
from checkpoint_factory import (  # noqa: E402
    schedule_text_config, without_engram, write_checkpoint)

REAL_WIDTHS = dict(head_dim=512, index_head_dim=128, qk_rope_head_dim=64, num_attention_heads=1,
                   hidden_size=64, q_lora_rank=32, o_lora_rank=32, o_groups=1,
                   moe_intermediate_size=32, index_n_heads=1, vocab_size=512)


def mlx_lm_nbytes(cache) -> int:
    return sum(c.nbytes for c in cache)


def global_bytes(folder: Path, tokens: int) -> tuple[float, float]:
    from mlx_lm.utils import load_model

    ids = mx.array(np.random.default_rng(0).integers(3, 500, (1, tokens)), dtype=mx.int32)
    ours = mlx_v41.load_model(folder, prefill_mode="full")
    cache = ours.make_cache()
    ours.prefill(ids, cache)
    mine = mlx_v41.cache_bytes(cache)["global_kv"] / tokens
    theirs_model, _ = load_model(folder)
    theirs_cache = theirs_model.make_cache()
    mx.eval(theirs_model(ids, cache=theirs_cache))
    short = theirs_model.make_cache()
    mx.eval(theirs_model(ids[:, :tokens // 2], cache=short))
    # mlx-lm keeps windows as growing buffers too: the per-token slope is what grows
    slope = (mlx_lm_nbytes(theirs_cache) - mlx_lm_nbytes(short)) / (tokens - tokens // 2)
    return mine, slope


def prefill_speed(folder: Path, prompt: int, step: int) -> dict:
    from mlx_lm.utils import load_model

    ids = mx.array(np.random.default_rng(1).integers(3, 500, (1, prompt)), dtype=mx.int32)
    results = {}
    for mode in ("ced", "full"):
        model = mlx_v41.load_model(folder, prefill_mode=mode)
        model.prefill(ids[:, :32], model.make_cache())
        start = time.perf_counter()
        mx.eval(model.prefill(ids, model.make_cache(), step_size=step))
        results[f"mlx_v41 {mode}"] = prompt / (time.perf_counter() - start)
        del model
        gc.collect()
    theirs, _ = load_model(folder)
    cache = theirs.make_cache()
    start = time.perf_counter()
    for i in range(0, prompt, step):
        mx.eval(theirs(ids[:, i:i + step], cache=cache)[:, -1])
    results["mlx-lm"] = prompt / (time.perf_counter() - start)
    return results


def peak_memory(folder: Path, prompt: int, step: int, which: str = "both") -> dict:
    """Peak MLX memory (bytes, weights included) during one prefill, each model on its own,
    and the seconds each prefill took."""
    from mlx_lm.utils import load_model

    ids = mx.array(np.random.default_rng(2).integers(3, 500, (1, prompt)), dtype=mx.int32)
    results = {}
    if which in ("both", "mlx_v41"):
        model = mlx_v41.load_model(folder)
        mx.reset_peak_memory()
        start = time.perf_counter()
        mx.eval(model.prefill(ids, model.make_cache(), step_size=step))
        results["mlx_v41 ced"] = mx.get_peak_memory()
        print(f"  mlx_v41 {prompt}-token prefill: {time.perf_counter() - start:.0f} s", flush=True)
        del model
        gc.collect()
    if which == "mlx_v41":
        return results
    theirs, _ = load_model(folder)
    start = time.perf_counter()
    mx.reset_peak_memory()
    cache = theirs.make_cache()
    for i in range(0, prompt, step):  # as mlx-lm's generate prefills: cache evaluated per chunk
        mx.eval(theirs(ids[:, i:i + step], cache=cache)[:, -1], [c.state for c in cache])
    results["mlx-lm"] = mx.get_peak_memory()
    print(f"  mlx-lm {prompt}-token prefill: {time.perf_counter() - start:.0f} s", flush=True)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=int, default=8, help="sliding_window (published 128)")
    parser.add_argument("--prompt-halos", type=int, default=8, help="prompt length in halos")
    parser.add_argument("--step", type=int, default=512, help="prefill chunk")
    parser.add_argument("--memory", type=int, nargs="*", default=[],
                        help="also report peak memory of prefills of these lengths (e.g. 8192)")
    parser.add_argument("--memory-only", action="store_true",
                        help="skip the bytes/token and speed measurements")
    parser.add_argument("--memory-model", choices=["both", "mlx_v41", "mlx-lm"], default="both",
                        help="whose peak memory to measure (separate processes can run in "
                        "parallel: the peak is per process)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        small = Path(tmp) / "schedule"
        config = without_engram({**schedule_text_config(), "sliding_window": args.window})
        write_checkpoint(small, config)
        if not args.memory_only:
            real = Path(tmp) / "real_widths"
            write_checkpoint(real, without_engram({**schedule_text_config(), **REAL_WIDTHS}))
            mine, theirs = global_bytes(real, 256)
            print(f"global KV bytes/token at real head widths: mlx_v41 {mine:.0f}, mlx-lm "
                  f"{theirs:.0f} (ratio {theirs / mine:.2f}x)")
            # the spec's halo at layer 20; the default ced_rollback adds `window` rows per layer
            halo = args.window + 19 * (args.window - 1)
            prompt = args.prompt_halos * halo
            speeds = prefill_speed(small, prompt, args.step)
            print(f"prefill, 40 + 3 layers, hidden 128, window {args.window} (halo {halo} rows), "
                  f"prompt {prompt} tokens in chunks of {args.step}:")
            for name, value in speeds.items():
                print(f"  {name:14s} {value:8.1f} tok/s")
            print(f"  CED / full {speeds['mlx_v41 ced'] / speeds['mlx_v41 full']:.2f}x, "
                  f"CED / mlx-lm {speeds['mlx_v41 ced'] / speeds['mlx-lm']:.2f}x")
        for length in args.memory:
            peaks = peak_memory(small, length, args.step, args.memory_model)
            print(f"peak memory, {length}-token prefill: " + ", ".join(
                f"{name} {value / 2**20:.1f} MiB" for name, value in peaks.items()), flush=True)


if __name__ == "__main__":
    main()
