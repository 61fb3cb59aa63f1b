"""The published widths with fewer layers and experts: prefill and decode ours vs mlx-lm in one run,
cache bytes per token, weight bytes a decode token reads against the minimum, and the LM head in
fp32 against bf16.

Checkpoint (random, published layout, tests/checkpoint_factory.py): hidden 5120, 64 heads x 512,
q_lora 1280, o_lora 1024 x 8 groups, window 128, index 32 heads x 128 and top-512, experts of
the real width 2304 (6 per token) -- but 6 layers (SWA, a ratio-2 owner and its reader, a ratio-1
owner that is the candidate source, a reader and a Reindex layer), 8 routed experts, one DSpark
stage (not run), a vocabulary of 8192 and no Engram, so that it fits a small machine.

* speed: the models take turns within each repeat (load from other processes falls on both);
  prefill of --prompt tokens in one chunk (logits and cache evaluated), then --decode steps.
* cache: bytes per token of the global KV (ours: `mlx_v41.cache_bytes`; mlx-lm: the growth of
  its cache arrays between two prompt lengths).
* bytes per decode token: the weights a token reads in our layout (every non-expert weight, the
  shared expert, 6 of the routed experts per layer) against the same weights at the checkpoint's
  stored precision (the minimum), plus the cache rows a token reads (computed).
* head: one decode-shaped head matmul at the full 129,280 x 5120, fp32 weights (the reference's)
  against bf16 weights (`head_dtype="bfloat16"`: products exact, fp32 accumulation, bf16 output),
  and what the bf16 head does to the logits of the goldens' prefill (tests/data/goldens, tiny
  and schedule), against the fp32 head and against the reference.

    python -m benchmarks.bench_real_width [--prompt 256 --decode 6 --repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # run from a checkout; the factory is a test helper

import mlx_v41  # noqa: E402
from benchmarks.bench_vs_mlx_lm import cache_arrays, load_mlx_lm  # noqa: E402
from checkpoint_factory import schedule_text_config, without_engram, write_checkpoint  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_v41.model.layers import head_logits  # noqa: E402

REAL = dict(
    hidden_size=5120, num_attention_heads=64, head_dim=512, q_lora_rank=1280, o_lora_rank=1024,
    o_groups=8, moe_intermediate_size=2304, n_routed_experts=8, num_experts_per_tok=6,
    index_n_heads=32, index_head_dim=128, index_topk=512, sliding_window=128, vocab_size=8192,
    qk_rope_head_dim=64, num_hidden_layers=6, compress_ratios=[0, 2, 2, 1, 1, 1, 0],
    num_nextn_predict_layers=1, kv_source_layer_ids=[1, 3], index_source_layer_ids=[1, 3, 5],
    candidate_source_layer_id=3, dspark_target_layer_ids=[3, 4, 5], dspark_n_routed_experts=2,
    dspark_num_experts_per_tok=2, candidate_topk_blocks=2048, candidate_block_size=8)
FULL_VOCAB = 129280
STORED_BITS = {"mxfp8": 8, "mxfp4": 4}  # checkpoint precision of our packed weights


def timed(call, cache, ids, tokens) -> tuple:
    start = time.perf_counter()
    mx.eval(call(ids, cache), cache_arrays(cache))
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    for token in tokens:
        mx.eval(call(token.reshape(1, 1), cache), cache_arrays(cache))
    return prefill, time.perf_counter() - start


def speed(folder: Path, args) -> None:
    model = mlx_v41.load_model(folder)
    ours = (lambda x, c: model(x, cache=c, last_only=True), model.make_cache)
    theirs = load_mlx_lm(folder)
    rng = np.random.default_rng(0)
    ids = mx.array(rng.integers(3, REAL["vocab_size"], (1, args.prompt)), dtype=mx.int32)
    tokens = mx.array(rng.integers(3, REAL["vocab_size"], args.decode), dtype=mx.int32)
    runs = {"mlx_v41": [], "mlx-lm": []}
    for name, (call, make) in (("mlx_v41", ours), ("mlx-lm", theirs)):  # warm-up
        timed(call, make(), ids[:, :16], tokens[:2])
    for repeat in range(args.repeats):
        for name, (call, make) in (("mlx_v41", ours), ("mlx-lm", theirs)):
            runs[name].append(timed(call, make(), ids, tokens))
            print(f"  repeat {repeat + 1} {name:8s} prefill {runs[name][-1][0]:6.1f} s, "
                  f"decode {runs[name][-1][1]:6.1f} s", flush=True)
    rates = {}
    for name, values in runs.items():
        prefill = args.prompt / statistics.median(v[0] for v in values)
        decode = args.decode / statistics.median(v[1] for v in values)
        rates[name] = (prefill, decode)
        print(f"{name:8s} prefill {prefill:7.2f} tok/s, decode {decode:6.3f} tok/s")
    print(f"ratio mlx_v41 / mlx-lm: prefill {rates['mlx_v41'][0] / rates['mlx-lm'][0]:.2f}x, "
          f"decode {rates['mlx_v41'][1] / rates['mlx-lm'][1]:.2f}x")
    cache_per_token(model, folder, ids)
    decode_bytes(model, args.prompt)


def cache_per_token(model, folder: Path, ids) -> None:
    from mlx_lm.utils import load_model

    cache = model.make_cache()
    model(ids, cache=cache)
    mine = mlx_v41.cache_bytes(cache)["global_kv"] / ids.shape[1]
    theirs, _ = load_model(folder)
    long, short = theirs.make_cache(), theirs.make_cache()
    mx.eval(theirs(ids, cache=long), theirs(ids[:, :ids.shape[1] // 2], cache=short))
    slope = (sum(c.nbytes for c in long) - sum(c.nbytes for c in short)) / (ids.shape[1] // 2)
    print(f"cache bytes/token (6 layers, owners 1 and 3): global KV mlx_v41 {mine:.0f}, "
          f"mlx-lm growth {slope:.0f} (windows included)")


def decode_bytes(model, context: int) -> None:
    """Weight bytes one decode token reads, ours and at stored precision, and cache rows."""
    cfg = model.cfg
    ours = stored = 0
    for name, value in tree_flatten(model.parameters()):
        if ".mtp." in f".{name}" or name.startswith("dspark") or name.startswith("model.embed"):
            continue  # the drafter is not run; the embedding reads one row
        share = cfg.num_experts_per_tok / cfg.n_routed_experts if "switch_mlp" in name else 1.0
        ours += value.nbytes * share
        stored += _stored_bytes(model, name, value) * share
    window = cfg.num_hidden_layers * cfg.sliding_window * (cfg.head_dim + cfg.head_dim // 32)
    roles = model.roles[:cfg.num_hidden_layers]
    selected = sum(cfg.index_topk * (cfg.head_dim // 2 + cfg.head_dim // 16)
                   for r in roles if r.ratio > 0)
    index = sum((context // r.ratio) * (cfg.index_head_dim // 2 + cfg.index_head_dim // 32)
                for r in roles if r.has_indexer)
    rows = window + selected + index
    print(f"bytes per decode token at context {context}: weights {ours / 1e6:.1f} MB in our "
          f"layout vs {stored / 1e6:.1f} MB at stored precision ({ours / stored:.2f}x); cache "
          f"rows {rows / 1e6:.2f} MB (window {window / 1e6:.2f}, selected {selected / 1e6:.2f}, "
          f"index keys {index / 1e6:.2f})")


def _stored_bytes(model, name: str, value: mx.array) -> float:
    """Bytes of a parameter at the checkpoint's precision: packed weights as stored (codes +
    one scale byte per 32), everything else bf16 (what the checkpoint ships)."""
    module = model
    for part in name.split(".")[:-1]:
        module = module[int(part)] if part.isdigit() else getattr(module, part)
    mode = getattr(module, "mode", None)
    if name.endswith(".weight") and mode in STORED_BITS:
        return value.size * 32 / STORED_BITS[mode] * STORED_BITS[mode] / 8
    if name.endswith(".scales"):
        return value.nbytes
    return value.size * 2


def head(args) -> None:
    """Full-vocabulary head: fp32 vs bf16 weights, decode shape; and the goldens' logits."""
    rng = np.random.default_rng(1)
    weight = mx.array(rng.standard_normal((FULL_VOCAB, REAL["hidden_size"]), np.float32) * 0.02)
    hidden = mx.array(rng.standard_normal((1, 1, REAL["hidden_size"]), np.float32))
    hidden = hidden.astype(mx.bfloat16)
    w16 = weight.astype(mx.bfloat16)
    w32 = w16.astype(mx.float32)  # the reference's head: bf16 values held in fp32
    mx.eval(w16, w32, hidden)
    del weight
    times = {"fp32": [], "bf16": []}
    for _ in range(args.head_repeats):
        for name, w in (("fp32", w32), ("bf16", w16)):
            start = time.perf_counter()
            mx.eval(head_logits(hidden, w))
            times[name].append(time.perf_counter() - start)
    t32, t16 = (statistics.median(times[k]) for k in ("fp32", "bf16"))
    print(f"head {FULL_VOCAB} x {REAL['hidden_size']}, one token: fp32 weights "
          f"{w32.nbytes / 1e9:.2f} GB {t32 * 1e3:.0f} ms, bf16 weights {w16.nbytes / 1e9:.2f} GB "
          f"{t16 * 1e3:.0f} ms ({t32 / t16:.2f}x)")
    del w16, w32
    for name in ("tiny", "schedule"):
        golden_logits(name)


def golden_logits(name: str) -> None:
    """A golden's prefill logits with `head_dtype="bfloat16"` against the default fp32 head
    (every position), and both against the reference's logits."""
    golden = ROOT / "tests/data/goldens" / name
    prompt = mx.load(str(golden / "prefill/inputs.safetensors"))["prompt_ids"][None]
    ref = mx.load(str(golden / "prefill/outputs.safetensors"))["logits_all"]
    got = {dtype: mlx_v41.load_model(golden / "hf", head_dtype=dtype)(
        prompt.astype(mx.int32))[0] for dtype in ("float32", "bfloat16")}
    l32, l16 = got["float32"], got["bfloat16"]
    diff = mx.abs(l16 - l32)
    agree = (l16.argmax(-1) == l32.argmax(-1)).astype(mx.float32).mean().item()
    print(f"  {name} ({l32.shape[0]} positions): bf16 head vs fp32 head: max |dlogit| "
          f"{diff.max().item():.4f} (relative to max |logit| "
          f"{diff.max().item() / mx.abs(l32).max().item():.2e}), mean {diff.mean().item():.5f}, "
          f"argmax agreement {agree:.3f}")
    for dtype, logits in got.items():
        err = mx.abs(logits - ref)
        ref_agree = (logits.argmax(-1) == ref.argmax(-1)).astype(mx.float32).mean().item()
        print(f"    {dtype} head vs the reference: max |dlogit| {err.max().item():.4f}, first 7 "
              f"positions {err[:7].max().item():.4f} (test: <= 2e-2), mean "
              f"{err.mean().item():.4f}, argmax agreement {ref_agree:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--decode", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--head-repeats", type=int, default=5)
    parser.add_argument("--skip-speed", action="store_true", help="only the head measurement")
    args = parser.parse_args()
    print(f"mlx {mx.__version__}, device {mx.default_device()}")
    if not args.skip_speed:
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            write_checkpoint(Path(tmp), without_engram({**schedule_text_config(), **REAL}),
                             engram=False)
            print(f"checkpoint written in {time.perf_counter() - start:.0f} s")
            speed(Path(tmp), args)
    head(args)


if __name__ == "__main__":
    main()
