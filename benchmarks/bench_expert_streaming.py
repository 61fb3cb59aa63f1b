"""Routed experts streamed from the model folder (`expert_memory`): a checkpoint whose experts
are larger than this machine's memory, and streamed against resident on one that fits.

Checkpoints: random, in the published layout, at the real widths (hidden 5120, expert width
2304, 6 experts per token, the attention widths of bench_real_width.py), no Engram, no drafter,
no vision, a vocabulary of 8192. The routed experts are the published FP4 tensors (I8 packed
FP4 + F8_E8M0 scale per 32): random code bytes, scale bytes 117..122 (finite, moderate values).
Each layer is one shard, written tensor by tensor under a hand-written safetensors header (in the
safetensors library's tensor order), so no shard is ever held in memory. A variant folder (the
first layers only, or other router biases) is a new config and index over symlinks to the same
shards, plus a small shard for what it changes.

Each load runs in a fresh subprocess (its peak RSS, VmHWM, is its own) after `sync; echo 3 >
/proc/sys/vm/drop_caches`, so every read is cold (expert reads also drop their pages after
reading). A run: one prompt of --prompt random tokens in one chunk, then --decode greedy steps
(the store's defaults: LFRU, read-ahead on); every step's logits are kept for comparison.
Bytes per decode token: loaded into slots (the store's counters) and read from storage
(/proc/self/io, which also counts read-ahead that went unused).

* --big: --layers (4) x 384 experts (28.9 GB of experts, more than the RAM here): a resident
  load is refused up front; the model streamed at 6GB, 12GB and 2GB (same tokens and logits;
  2GB holds fewer experts than the run reads, so it evicts); the first --restrict layers (1) of
  the same shards, resident against streamed at --restrict-budgets (same tokens and logits; the
  smaller budget evicts and runs the prefill in waves).
* --fits: --fits-layers (2) x --fits-experts (64), resident against streamed at 10/25/50/100 % of
  its experts, for the checkpoint's random routers and for routers skewed by a Zipf-like selection
  bias (`layers.L.ffn.gate.bias`; it changes which experts are chosen, not their weights).
* --read-ahead: the --fits checkpoints at 10 and 25 % of their experts with the read-ahead off
  (`expert_prefetch=0`) and on (16): decode speed, waits, and disk bytes beside the loaded ones.
* --mac: `mlx_v41.inspect --mac-table` (the decode bound at 7 GB/s per Mac and recipe) beside
  ds4's measured 15-16 tok/s.

    python benchmarks/bench_expert_streaming.py --big [--keep --dir D --layers 4]
    python benchmarks/bench_expert_streaming.py --fits [--prompt 16 --decode 8]
    python benchmarks/bench_expert_streaming.py --read-ahead [--repeats 2]
    python benchmarks/bench_expert_streaming.py --mac
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # run from a checkout; the factory is a test helper

from checkpoint_factory import schedule_text_config, without_engram  # noqa: E402
from mlx_v41.checkpoint.random_checkpoint import (DTYPE_RANK, HEADER_ALIGN, Tensor,  # noqa: E402
                                                  checkpoint_groups, encode_bf16, root_config,
                                                  write_safetensors)

WIDTHS = dict(
    hidden_size=5120, num_attention_heads=64, head_dim=512, q_lora_rank=1280, o_lora_rank=1024,
    o_groups=8, moe_intermediate_size=2304, num_experts_per_tok=6, index_n_heads=32,
    index_head_dim=128, index_topk=512, sliding_window=128, vocab_size=8192,
    qk_rope_head_dim=64, candidate_topk_blocks=2048, candidate_block_size=8,
    num_nextn_predict_layers=0, dspark_target_layer_ids=[])
PUBLISHED_EXPERTS = 384
FP4_PER_BYTE, SCALE_GROUP = 2, 32  # published experts: two E2M1 codes a byte, one E8M0 per 32
# E8M0 scale bytes (2^(byte - 127)) of the random experts: uniform random FP4 codes have an RMS
# of 2.9, so these give w1/w3 a std near 4/sqrt(hidden) and w2 near 0.25/sqrt(width), as the
# factory's experts have.
SCALE_BYTES = {"w1": (120, 122), "w3": (120, 122), "w2": (117, 119)}
DISK_MARGIN = 2 * 10**9  # bytes left free beyond the checkpoint
GB = 10**9
CHILD_TIMEOUT = 1800  # seconds for one subprocess run
STREAMING_FILES = ("mlx_v41/model", "mlx_v41/checkpoint")  # whose state a commit line names


# ------------------------------------------------------------------------------ checkpoints

def text_config(layers: int, experts: int) -> dict:
    """The real widths over `layers` layers with valid roles: SWA, a ratio-2 owner, then a
    ratio-1 owner (the candidate source) and ratio-1 Reindex layers."""
    ratios = [0, 2, 1][:layers] + [1] * max(0, layers - 3)
    kv = [layer for layer in (1, 2) if layer < layers]
    cfg = {**schedule_text_config(), **WIDTHS, "num_hidden_layers": layers,
           "n_routed_experts": experts, "compress_ratios": ratios, "kv_source_layer_ids": kv,
           "index_source_layer_ids": list(range(1, layers)),
           "candidate_source_layer_id": 2 if layers > 2 else -1}
    return without_engram(cfg)


def expert_tensors(layer: int, expert: int, cfg: dict) -> dict:
    """name -> (dtype, shape) of one published routed expert."""
    d, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    out = {}
    for proj, (rows, cols) in (("w1", (inter, d)), ("w3", (inter, d)), ("w2", (d, inter))):
        base = f"layers.{layer}.ffn.experts.{expert}.{proj}"
        out[f"{base}.weight"] = ("I8", (rows, cols // FP4_PER_BYTE))
        out[f"{base}.scale"] = ("F8_E8M0", (rows, cols // SCALE_GROUP))
    return out


def expert_bytes(cfg: dict) -> int:
    """Bytes of every routed expert of a text config."""
    one = sum(math.prod(shape) for _, shape in expert_tensors(0, 0, cfg).values())
    return one * cfg["num_hidden_layers"] * cfg["n_routed_experts"]


def _expert_data(name: str, dtype: str, shape: tuple, seed: int) -> np.ndarray:
    """Random bytes of one expert tensor: any byte is two valid FP4 codes; scales in range."""
    size = math.prod(shape)
    stream = np.random.SFC64([seed, zlib.crc32(name.encode())])
    if dtype == "I8":
        return stream.random_raw(-(-size // 8)).view(np.uint8)[:size]
    low, high = SCALE_BYTES[name.split(".")[-2]]
    return np.random.Generator(stream).integers(low, high + 1, size, dtype=np.uint8)


def router_tensors(layer: int, cfg: dict, seed: int) -> dict:
    """The gate of one layer with `n_routed_experts` rows (the non-expert groups are drawn with
    none): weight std 1/sqrt(hidden), selection biases as the factory draws them."""
    d, experts = cfg["hidden_size"], cfg["n_routed_experts"]
    p = f"layers.{layer}.ffn.gate."
    out = {}
    for name, shape, std, dtype in ((f"{p}weight", (experts, d), d ** -0.5, "BF16"),
                                    (f"{p}bias", (experts,), 0.3, "F32"),
                                    (f"{p}bias_vl", (experts,), 0.25, "F32")):
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        values = std * rng.standard_normal(shape)
        out[name] = Tensor(dtype, encode_bf16(values) if dtype == "BF16"
                           else values.astype(np.float32))
    return out


def write_layer_shard(path: Path, tensors: dict, layer: int, cfg: dict, seed: int) -> int:
    """One layer's shard: its small tensors (held) and its experts (drawn and written one
    tensor at a time) under one header, in the safetensors library's order; -> payload bytes."""
    specs = {name: (t.dtype, t.data.shape) for name, t in tensors.items()}
    for expert in range(cfg["n_routed_experts"]):
        specs.update(expert_tensors(layer, expert, cfg))
    order = sorted(specs, key=lambda k: (-DTYPE_RANK[specs[k][0]], k))
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name in order:
        dtype, shape = specs[name]
        nbytes = math.prod(shape) * (4 if dtype == "F32" else 2 if dtype == "BF16" else 1)
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % HEADER_ALIGN)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name in order:
            data = tensors[name].data if name in tensors else \
                _expert_data(name, *specs[name], seed)
            f.write(np.ascontiguousarray(data).data)
    return offset


def write_checkpoint(folder: Path, layers: int, experts: int, seed: int = 0) -> dict:
    """A random real-width checkpoint (module docstring) in `folder`, one shard per layer;
    -> {"expert_bytes", "bytes", "seconds"}."""
    tic = time.perf_counter()
    cfg = text_config(layers, experts)
    config = root_config(cfg)
    drawn = {**config, "text_config": {**cfg, "n_routed_experts": 0}}
    # No vision tower: its group and the image delimiters are left out.
    groups = checkpoint_groups(drawn, seed)[1:]
    groups[0] = {k: v for k, v in groups[0].items() if not k.startswith("image_")}
    names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    folder.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for i, (name, tensors) in enumerate(zip(names, groups)):
        layer = i - 1  # groups: embed, layers..., head
        if 0 <= layer < layers:
            tensors = {**tensors, **router_tensors(layer, cfg, seed)}
            total += write_layer_shard(folder / name, tensors, layer, cfg, seed)
            weight_map.update({k: name for k in tensors})
            weight_map.update({k: name for e in range(experts)
                               for k in expert_tensors(layer, e, cfg)})
            print(f"  {name}: layer {layer} written ({time.perf_counter() - tic:.0f} s)",
                  flush=True)
        else:
            total += write_safetensors(folder / name, tensors)
            weight_map.update({k: name for k in tensors})
    _write_index(folder, weight_map, config, total)
    os.sync()
    return {"expert_bytes": expert_bytes(cfg), "bytes": total,
            "seconds": time.perf_counter() - tic}


def _write_index(folder: Path, weight_map: dict, config: dict, total: int) -> None:
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def write_variant(source: Path, folder: Path, layers: int | None = None,
                  replaced: dict | None = None) -> Path:
    """A folder over `source`'s shards (symlinks): its first `layers` layers (a config with the
    roles of `text_config(layers, ...)`, the index without the other layers' tensors) and/or
    `replaced` tensors written to a shard of their own."""
    config = json.loads((source / "config.json").read_text())
    cfg = config["text_config"]
    weight_map = json.loads((source / "model.safetensors.index.json").read_text())["weight_map"]
    if layers is not None:
        config["text_config"] = text_config(layers, cfg["n_routed_experts"])
        weight_map = {k: v for k, v in weight_map.items()
                      if not k.startswith("layers.") or int(k.split(".")[1]) < layers}
    folder.mkdir(parents=True, exist_ok=True)
    for shard in sorted(set(weight_map.values())):
        (folder / shard).symlink_to(source / shard)
    if replaced:
        write_safetensors(folder / "replaced.safetensors", replaced)
        weight_map.update(dict.fromkeys(replaced, "replaced.safetensors"))
    _write_index(folder, weight_map, config, 0)
    return folder


def zipf_biases(cfg: dict, strength: float, seed: int) -> dict:
    """Skewed selection biases: per layer, expert e of popularity rank r_e (a random
    permutation) gets -strength * log(r_e), so a few experts win most tokens."""
    out = {}
    for layer in range(cfg["num_hidden_layers"]):
        rng = np.random.default_rng([seed, layer, 7])
        ranks = rng.permutation(cfg["n_routed_experts"]) + 1
        out[f"layers.{layer}.ffn.gate.bias"] = Tensor(
            "F32", (-strength * np.log(ranks)).astype(np.float32))
    return out


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def roomiest_folder(explicit: str | None) -> Path:
    """The temp folder with the most free disk (never inside the checkout)."""
    if explicit:
        return Path(explicit)
    candidates = {Path(tempfile.gettempdir()), Path("/var/tmp")}
    usable = [p for p in candidates if p.is_dir() and os.access(p, os.W_OK)
              and ROOT not in (p.resolve(), *p.resolve().parents)]
    return max(usable, key=free_bytes)


# ------------------------------------------------------------------------------ one run

def _proc(file: str, key: str, unit: int = 1) -> int:
    """A field of /proc/self/`file` times `unit` (0 where there is no /proc)."""
    path = Path("/proc/self") / file
    lines = path.read_text().splitlines() if path.is_file() else []
    return next((int(line.split()[1]) * unit for line in lines if line.startswith(f"{key}:")), 0)


def _disk_reads() -> int:
    """Bytes this process has read from storage (page-cache hits excluded, read-ahead that
    went unused included)."""
    return _proc("io", "read_bytes")


def _peak_rss() -> int:
    """This process's peak RSS. Linux keeps `ru_maxrss` across exec, so a child started by a
    large parent would report the parent's; VmHWM belongs to this process's own memory map."""
    return _proc("status", "VmHWM", 1024) or \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS


def child(spec: dict) -> None:
    """One load and greedy run in this process (a fresh one); writes its JSON and logits."""
    import mlx.core as mx
    import mlx_v41
    from benchmarks.bench_vs_mlx_lm import cache_arrays

    result, tic = {"expert_memory": spec["expert_memory"]}, time.perf_counter()
    try:
        model = mlx_v41.load_model(spec["folder"], expert_memory=spec["expert_memory"],
                                   expert_prefetch=spec.get("expert_prefetch", 16))
    except ValueError as e:  # a refused plan (ConfigError is a ValueError too)
        result.update(refused=str(e), seconds=time.perf_counter() - tic, peak_rss=_peak_rss())
        Path(spec["out"]).write_text(json.dumps(result))
        return
    result.update(load_seconds=time.perf_counter() - tic, plan=model.expert_plan.line())
    store = model.expert_store
    vocab = model.cfg.vocab_size
    ids = np.random.default_rng(spec["seed"]).integers(3, vocab, (1, spec["prompt"]))
    cache = model.make_cache()
    start, disk = (store.stats.snapshot() if store else None), _disk_reads()
    tic = time.perf_counter()
    logits = model(mx.array(ids, dtype=mx.int32), cache=cache, last_only=True)
    mx.eval(logits, cache_arrays(cache))
    result["prefill_seconds"] = time.perf_counter() - tic
    prefilled, result["prefill_disk"] = (store.stats.snapshot() if store else None), \
        _disk_reads() - disk
    steps = [np.array(logits[0, -1].astype(mx.float32))]
    tic = time.perf_counter()
    for _ in range(spec["decode"]):
        token = mx.array([[int(steps[-1].argmax())]], dtype=mx.int32)
        logits = model(token, cache=cache)
        mx.eval(logits, cache_arrays(cache))
        steps.append(np.array(logits[0, -1].astype(mx.float32)))
    result["decode_seconds"] = time.perf_counter() - tic
    result["decode_disk"] = _disk_reads() - disk - result["prefill_disk"]
    result["tokens"] = [int(s.argmax()) for s in steps]
    if store:
        result["prefill_stats"] = prefilled.since(start).as_dict()
        result["decode_stats"] = store.stats.since(prefilled).as_dict()
        result["slots_bytes"] = store.nbytes
    result.update(expert_bytes=model.expert_plan.expert_bytes,
                  other_bytes=model.expert_plan.other_bytes, peak_rss=_peak_rss(),
                  mx_peak=mx.get_peak_memory())
    np.save(spec["logits"], np.stack(steps))
    Path(spec["out"]).write_text(json.dumps(result))


def drop_page_cache() -> bool:
    """sync and drop the page cache (root); False when not allowed (the reads are warm)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def run(folder: Path, expert_memory, args, work: Path, tag: str,
        refusal: bool = False, prefetch: int = 16) -> dict:
    """`child` in a fresh subprocess after dropping the page cache; -> its result (with
    "logits", every step's, and "cold"). A refused load ends the benchmark unless `refusal`."""
    spec = {"folder": str(folder), "expert_memory": str(expert_memory), "prompt": args.prompt,
            "decode": args.decode, "seed": args.seed, "out": str(work / f"{tag}.json"),
            "logits": str(work / f"{tag}.npy"), "expert_prefetch": prefetch}
    cold = drop_page_cache()
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)],
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT)
    if proc.returncode != 0:
        print(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise SystemExit(f"run {tag} ({expert_memory}) failed with exit status "
                         f"{proc.returncode}")
    result = json.loads(Path(spec["out"]).read_text())
    result["cold"] = cold
    if "refused" in result and not refusal:
        raise SystemExit(f"run {tag}: the load was refused: {result['refused']}")
    if "refused" not in result:
        result["logits"] = np.load(spec["logits"])
    return result


def same_output(a: dict, b: dict) -> bool:
    """Identical greedy tokens and bit-identical logits at every step."""
    return a["tokens"] == b["tokens"] and np.array_equal(a["logits"], b["logits"])


def check_same(reference: dict, other: dict, what: str) -> None:
    if not same_output(reference, other):
        diff = np.abs(reference["logits"] - other["logits"]).max()
        raise SystemExit(f"MISMATCH {what}: tokens {reference['tokens']} vs {other['tokens']}, "
                         f"max |dlogit| {diff}")
    print(f"  {what}: {len(reference['tokens'])} tokens and every step's logits identical",
          flush=True)


# ------------------------------------------------------------------------------ reports

def _g(n: float) -> str:
    return f"{n / GB:.2f} GB"


def measures(r: dict, args) -> dict:
    """The table's numbers of one run."""
    out = {"prefill": args.prompt / r["prefill_seconds"],
           "decode": args.decode / r["decode_seconds"], "peak_rss": r["peak_rss"],
           "mx_peak": r["mx_peak"], "disk": r["prefill_disk"] + r["decode_disk"]}
    if "decode_stats" in r:
        d, p = r["decode_stats"], r["prefill_stats"]
        out.update(hit=d["hit_rate"], loaded_token=d["bytes_read"] / args.decode,
                   disk_token=r["decode_disk"] / args.decode,
                   wait=d["wait_seconds"] / r["decode_seconds"],
                   prefill_wait=p["wait_seconds"] / r["prefill_seconds"],
                   read_ahead=d["read_ahead"] + p["read_ahead"], loads=d["loads"] + p["loads"],
                   waves=d["waves"] + p["waves"])
    return out


def _stream_cells(m: dict) -> str:
    """hit rate | MB per decode token loaded / from disk | decode wait | prefill wait."""
    if "hit" not in m:
        return "- | - | - | -"
    return (f"{m['hit']:.1%} | {m['loaded_token'] / 1e6:,.0f} / {m['disk_token'] / 1e6:,.0f} | "
            f"{m['wait']:.0%} | {m['prefill_wait']:.0%}")


STREAM_HEADER = ("decode hit rate | MB per decode token: loaded / from disk | decode time "
                 "waiting on reads | prefill time waiting on reads")


def print_runs(rows: list, args) -> None:
    """rows: (label, result); one markdown table."""
    print(f"| run | prefill {args.prompt} tok/s | decode tok/s | {STREAM_HEADER} | GB from "
          "disk (run) | peak RSS | MLX peak |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, r in rows:
        m = measures(r, args)
        print(f"| {label} | {m['prefill']:.3f} | {m['decode']:.3f} | {_stream_cells(m)} | "
              f"{m['disk'] / GB:.2f} | {_g(m['peak_rss'])} | {_g(m['mx_peak'])} |")


# ------------------------------------------------------------------------------ --big

def commit_line() -> str:
    """The checkout's commit, and whether the streaming code differs from it."""
    def git(*cmd):
        return subprocess.run(["git", "-C", str(ROOT), *cmd], capture_output=True,
                              text=True).stdout.strip()

    dirty = git("status", "--porcelain", "--", *STREAMING_FILES)
    return f"commit {git('rev-parse', '--short', 'HEAD')}" + \
        (f" (streaming code modified: {' '.join(dirty.split()[1::2])})" if dirty else "")


def big(args) -> None:
    cfg = text_config(args.layers, PUBLISHED_EXPERTS)
    need = expert_bytes(cfg)
    base = roomiest_folder(args.dir)
    free = free_bytes(base)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    print(commit_line())
    print(f"--big: {args.layers} layers x {PUBLISHED_EXPERTS} experts = {_g(need)} of routed "
          f"experts; RAM {_g(ram)}; {base} has {_g(free)} free")
    if free < need + DISK_MARGIN:
        raise SystemExit(f"refused: {base} has {_g(free)} free, the checkpoint needs "
                         f"{_g(need + DISK_MARGIN)} (with {_g(DISK_MARGIN)} to spare); "
                         "pass --dir")
    work = Path(tempfile.mkdtemp(prefix="mlx_v41_big_", dir=base))
    try:
        written = write_checkpoint(work / "full", args.layers, PUBLISHED_EXPERTS, args.seed)
        print(f"written {_g(written['bytes'])} ({_g(written['expert_bytes'])} of experts) in "
              f"{written['seconds']:.0f} s ({written['bytes'] / written['seconds'] / GB:.2f} "
              "GB/s, drawing the values included)", flush=True)
        first = write_variant(work / "full", work / "first", layers=args.restrict)
        big_runs(work, first, args)
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work)
            print(f"deleted {work}; {base} now has {_g(free_bytes(base))} free")


def big_runs(work: Path, first: Path, args) -> None:
    refused = run(work / "full", "resident", args, work, "resident", refusal=True)
    if "refused" not in refused or "do not fit" not in refused["refused"] \
            or "--expert-memory" not in refused["refused"]:
        raise SystemExit(f"a resident load was not refused: {refused}")
    print(f"(a) expert_memory='resident' refused after {refused['seconds']:.1f} s (peak RSS "
          f"{_g(refused['peak_rss'])}):\n    {refused['refused']}", flush=True)
    runs = {}
    for budget in args.budgets:
        runs[budget] = run(work / "full", budget, args, work, f"full-{budget}")
        print(f"  {args.layers} layers, {budget}: {runs[budget]['plan']}", flush=True)
    for budget in args.budgets[1:]:
        check_same(runs[args.budgets[0]], runs[budget],
                   f"{args.layers} layers, {args.budgets[0]} vs {budget}")
    first_layers = f"first {args.restrict} layer" + "s" * (args.restrict > 1)
    restricted = {"resident": run(first, "resident", args, work, "first-resident")}
    for budget in args.restrict_budgets:
        restricted[budget] = run(first, budget, args, work, f"first-{budget}")
        check_same(restricted["resident"], restricted[budget],
                   f"{first_layers}, resident vs {budget}")
    print(f"\nprompt {args.prompt} tokens (one chunk), {args.decode} greedy decode steps; cold "
          "page cache before each run (`echo 3 > drop_caches`)" if refused["cold"] else
          "\n(page cache NOT dropped: not root; the reads may be warm)")
    rows = [(f"{args.layers} layers, {b}", r) for b, r in runs.items()]
    rows += [(f"{first_layers}, {b}", r) for b, r in restricted.items()]
    print_runs(rows, args)
    for label, r in rows:
        print(f"  {label}: {held_line(r)}; tokens {r['tokens']}")
    for label, r in rows:
        m = measures(r, args)
        if "loads" in m:
            print(f"  {label}: {m['loads']} experts loaded ({m['read_ahead']} of them read "
                  f"ahead), {m['waves']} calls in waves")


def held_line(r: dict) -> str:
    """What a run holds against its peak RSS."""
    streamed = "slots_bytes" in r
    held = (r["slots_bytes"] if streamed else r["expert_bytes"]) + r["other_bytes"]
    return (f"{'slots' if streamed else 'experts'} {_g(held - r['other_bytes'])} + other "
            f"weights {_g(r['other_bytes'])}; peak RSS {_g(r['peak_rss'])} "
            f"({r['peak_rss'] / held:.2f}x)")


# ------------------------------------------------------------------------------ --fits

def fits(args) -> None:
    print(commit_line())
    base = roomiest_folder(args.dir)
    work = Path(tempfile.mkdtemp(prefix="mlx_v41_fits_", dir=base))
    try:
        written = write_checkpoint(work / "random", args.fits_layers, args.fits_experts,
                                   args.seed)
        cfg = text_config(args.fits_layers, args.fits_experts)
        write_variant(work / "random", work / "skewed",
                      replaced=zipf_biases(cfg, args.skew, args.seed))
        total = written["expert_bytes"]
        print(f"--fits: {args.fits_layers} layers x {args.fits_experts} experts = {_g(total)} "
              f"of experts, written in {written['seconds']:.0f} s; prompt {args.prompt} tokens "
              f"(one chunk), {args.decode} greedy decode steps; cold page cache before each "
              "run", flush=True)
        budgets = ["resident"] + [str(int(total * f / 100)) for f in args.fractions]
        labels = ["resident"] + [f"{f:g} %" for f in args.fractions]
        results = {}
        for repeat in range(args.repeats):
            order = list(zip(labels, budgets))[::-1 if repeat % 2 else 1]  # drift cancels
            for routing in ("random", "skewed"):
                for label, budget in order:
                    r = run(work / routing, budget, args, work, f"{routing}-{repeat}-{label}")
                    results.setdefault((routing, label), []).append(r)
                    m = measures(r, args)
                    print(f"  {routing:6s} {label:8s} prefill {m['prefill']:.3f} tok/s decode "
                          f"{m['decode']:.3f} tok/s" + (f" hit {m['hit']:.1%}" if "hit" in m
                                                        else ""), flush=True)
        for routing in ("random", "skewed"):
            resident = results[(routing, "resident")][0]
            print(f"\n{routing} routing: greedy tokens {resident['tokens']}")
            for label in labels[1:]:
                for r in results[(routing, label)]:
                    check_same(resident, r, f"{routing} routing, resident vs {label}")
            fits_table(routing, labels, results, args)
    finally:
        shutil.rmtree(work)


def fits_table(routing: str, labels: list, results: dict, args) -> None:
    def median(label, key):
        return statistics.median(measures(r, args)[key] for r in results[(routing, label)])

    print(f"\n{routing} routing (medians of {args.repeats}):")
    print(f"| experts in memory | prefill {args.prompt} tok/s | decode tok/s | prefill / "
          f"resident | decode / resident | {STREAM_HEADER} | peak RSS |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    base_p, base_d = median("resident", "prefill"), median("resident", "decode")
    for label in labels:
        p, d = median(label, "prefill"), median(label, "decode")
        m = {key: median(label, key) for key in measures(results[(routing, label)][0], args)}
        print(f"| {label} | {p:.3f} | {d:.3f} | {p / base_p:.2f}x | {d / base_d:.2f}x | "
              f"{_stream_cells(m)} | {_g(m['peak_rss'])} |")


# ------------------------------------------------------------------------------ --read-ahead

def read_ahead(args) -> None:
    """The --fits checkpoint at 10 and 25 % of its experts, read-ahead off (0) and on (16)."""
    base = roomiest_folder(args.dir)
    work = Path(tempfile.mkdtemp(prefix="mlx_v41_ahead_", dir=base))
    try:
        write_checkpoint(work / "random", args.fits_layers, args.fits_experts, args.seed)
        cfg = text_config(args.fits_layers, args.fits_experts)
        write_variant(work / "random", work / "skewed",
                      replaced=zipf_biases(cfg, args.skew, args.seed))
        total = expert_bytes(cfg)
        runs = [(f, p) for f in (10, 25) for p in (0, 16)]
        results = {}
        for repeat in range(args.repeats):
            for routing in ("random", "skewed"):
                for fraction, prefetch in runs[::-1 if repeat % 2 else 1]:
                    r = run(work / routing, int(total * fraction / 100), args, work,
                            f"{routing}-{repeat}-{fraction}-{prefetch}", prefetch=prefetch)
                    results.setdefault((routing, fraction, prefetch), []).append(r)
        print(f"| routing | experts in memory | read-ahead | decode tok/s | {STREAM_HEADER} "
              "| loads read ahead |")
        print("|---|---|---|---|---|---|---|---|---|")
        for (routing, fraction, prefetch), rs in results.items():
            check_same(rs[0], results[(routing, fraction, 0)][0],
                       f"{routing} {fraction} %, read-ahead {prefetch} vs 0")
            m = {k: statistics.median(measures(r, args)[k] for r in rs)
                 for k in measures(rs[0], args)}
            print(f"| {routing} | {fraction} % | {prefetch} | {m['decode']:.3f} | "
                  f"{_stream_cells(m)} | {m['read_ahead'] / max(m['loads'], 1):.0%} |")
    finally:
        shutil.rmtree(work)


# ------------------------------------------------------------------------------ --mac

def mac() -> None:
    from mlx_v41.cli.inspect import mac_table, mac_table_notes
    from mlx_v41.model.config import ModelArgs, official_config_path

    print(mac_table(ModelArgs.from_file(official_config_path())))
    print("\n" + mac_table_notes())
    print("\nMeasured (ds4): 15-16 tok/s decode, 2-bit V4.1 Flash streamed from SSD, M5 Max "
          "128 GB; compare the 128 GB mixed_2_8 row.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--big", action="store_true", help="the checkpoint larger than memory")
    add("--fits", action="store_true", help="streamed vs resident on one that fits")
    add("--mac", action="store_true", help="the computed Mac decode bounds")
    add("--read-ahead", action="store_true",
        help="the --fits checkpoint at 10/25 %% with the read-ahead off and on")
    add("--child", help=argparse.SUPPRESS)
    add("--prompt", type=int, default=16)
    add("--decode", type=int, default=8)
    add("--seed", type=int, default=0)
    add("--dir", help="where the checkpoints go (default: the temp folder with most free disk)")
    add("--keep", action="store_true", help="keep the --big checkpoint")
    add("--layers", type=int, default=4, help="--big: layers of 384 experts")
    add("--budgets", nargs="+", default=["6GB", "12GB", "2GB"],
        help="--big: the streamed budgets (the first is compared with the others)")
    add("--restrict", type=int, default=1, help="--big: layers of the resident comparison")
    add("--restrict-budgets", nargs="+", default=["2GB", "0.5GB"])
    add("--fits-layers", type=int, default=2)
    add("--fits-experts", type=int, default=64)
    add("--fractions", type=float, nargs="+", default=[10, 25, 50, 100])
    add("--skew", type=float, default=1.0, help="--fits: Zipf strength of the skewed biases")
    add("--repeats", type=int, default=2,
        help="--fits: rounds of runs, every other one in reverse order (medians)")
    args = parser.parse_args()
    if args.child:
        return child(json.loads(args.child))
    if not (args.big or args.fits or args.mac or args.read_ahead):
        parser.error("pass --big, --fits, --read-ahead and/or --mac")
    if args.read_ahead:
        read_ahead(args)
    if args.mac:
        mac()
    if args.fits:
        fits(args)
    if args.big:
        big(args)


if __name__ == "__main__":
    main()
