"""mlx_v41.convert: peak memory of a synthetic multi-shard conversion, and output sizes per recipe
for the real model.

    python -m benchmarks.bench_convert             # peak memory (writes ~1.5 GB under --work)
    python -m benchmarks.bench_convert --convert-args "--quant-predicate mixed_3_8"
    python -m benchmarks.bench_convert --sizes     # real-model sizes per recipe (no data)

Peak memory: tests/checkpoint_factory.py writes a checkpoint in the published layout with wider
layers (hidden 1024, 64 experts of 512), one shard per layer; the converter runs in a child
process and its peak resident set (ru_maxrss, which also counts mapped file pages) is compared
with the largest input shard.

Sizes: the real checkpoint's headers (every tensor of spec checkpoint.md §3, built by the test
factory's catalogue with the official config) over sparse files, so the converter's own planner
runs on the real inventory and nothing is read or written; the inventory is checked against the
spec's totals (96,085 tensors, 510,286,023,000 bytes) first.
"""

from __future__ import annotations

import argparse
import json
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import checkpoint_factory as factory  # noqa: E402
import mlx_v41.checkpoint.random_checkpoint as catalogue  # noqa: E402

SPEC_TENSORS, SPEC_BYTES = 96_085, 510_286_023_000  # spec checkpoint.md §6
RECIPES = [
    ("official (default)", {}),
    ("--quant-predicate mixed_4_8", {"quant_predicate": "mixed_4_8"}),
    ("--quant-predicate mixed_3_8", {"quant_predicate": "mixed_3_8"}),
    ("--quant-predicate mixed_2_8", {"quant_predicate": "mixed_2_8"}),
    ("-q (affine 4-bit, group 64)", {"quantize": True}),
    ("-q --q-bits 8 (affine, group 64)", {"quantize": True, "q_bits": 8}),
    ("-q --q-mode mxfp8", {"quantize": True, "q_mode": "mxfp8"}),
]


# ---------------------------------------------------------------- real-size inventory

class _Shapes(catalogue._Generator):
    """The factory's tensor catalogue with zero-memory placeholder data (shapes only)."""

    STORAGE = {"F32": np.float32, "BF16": np.uint16, "F8_E4M3": np.uint8, "F8_E8M0": np.uint8,
               "I8": np.int8}

    def _put(self, name, dtype, shape):
        data = np.broadcast_to(np.zeros(1, self.STORAGE[dtype]), tuple(shape))
        self.tensors[name] = catalogue.Tensor(dtype, data)

    def f32(self, name, shape, std, mean=0.0):
        self._put(name, "F32", shape)

    def bf16(self, name, shape, std, mean=0.0):
        self._put(name, "BF16", shape)

    def fp8(self, base, out_dims, in_dims, gain=1.0):
        self._put(f"{base}.weight", "F8_E4M3", (out_dims, in_dims))
        self._put(f"{base}.scale", "F8_E8M0", (-(-out_dims // 32), -(-in_dims // 32)))

    def rows(self, base, out_dims, in_dims, fmt, std):
        packed = (out_dims, in_dims // 2) if fmt == "fp4" else (out_dims, in_dims)
        self._put(f"{base}.weight", "I8" if fmt == "fp4" else "F8_E4M3", packed)
        self._put(f"{base}.scale", "F8_E8M0", (out_dims, in_dims // 32))


def write_headers(folder: Path, config: dict) -> tuple[int, int]:
    """Published-layout shards holding only headers (sparse payload); -> (tensors, bytes)."""
    original = catalogue._Generator
    catalogue._Generator = _Shapes
    try:
        groups = catalogue.checkpoint_groups(config)
    finally:
        catalogue._Generator = original
    folder.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for i, tensors in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for key, t in tensors.items():
            header[key] = {"dtype": t.dtype, "shape": list(t.data.shape),
                           "data_offsets": [offset, offset + t.data.nbytes]}
            offset += t.data.nbytes
        blob = json.dumps(header).encode()
        blob += b" " * (-len(blob) % 8)
        with open(folder / name, "wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            f.truncate(8 + len(blob) + offset)
        weight_map.update({k: name for k in tensors})
        total += offset
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps(config))
    return len(weight_map), total


def gb(n: int) -> str:
    return f"{n / 1e9:,.2f} GB"


def sizes(work: Path) -> None:
    from mlx_v41.model.config import official_config_path
    from mlx_v41.convert.plan import make_plan
    from mlx_v41.convert.recipes import make_recipe
    from mlx_v41.convert.source import Source

    config = json.loads(official_config_path().read_text())
    folder = work / "real-headers"
    count, total = write_headers(folder, config)
    print(f"inventory: {count:,} tensors, {total:,} bytes "
          f"({'matches' if (count, total) == (SPEC_TENSORS, SPEC_BYTES) else 'DIFFERS FROM'} "
          "spec checkpoint.md §6)")
    print("| recipe | weights | DSpark drafter | Engram tables | extras (vision) | total | "
          "without drafter and extras |")
    print("|---|---|---|---|---|---|---|")
    for label, kwargs in RECIPES:
        start = time.monotonic()
        source = Source(folder, {"vision", "dspark"})
        recipe = make_recipe(source.skeleton(), **kwargs)
        s = make_plan(source, recipe, 5 * 10**9).sizes()
        print(f"| `{label}` | {gb(s['weights'])} | {gb(s['dspark'])} | {gb(s['engram_tables'])} | "
              f"{gb(s['extras'])} | {gb(s['total'])} | "
              f"{gb(s['total'] - s['extras'] - s['dspark'])} |", flush=True)
        print(f"<!-- planned in {time.monotonic() - start:.0f} s -->", file=sys.stderr)


# ---------------------------------------------------------------- peak memory

def synthetic(folder: Path) -> Path:
    cfg = factory.tiny_text_config(hidden_size=1024, moe_intermediate_size=512,
                                   n_routed_experts=64)
    return factory.write_checkpoint(folder, cfg)


# Runs in a fresh interpreter: the converter's CLI (when given arguments), then the process's
# own peak resident set. Linux: VmHWM (reset at exec, unlike ru_maxrss, which a forked child
# inherits from its parent); macOS: ru_maxrss (bytes).
PEAK_PROBE = r"""
import json, resource, sys
import mlx_v41.convert.cli as cli
code = cli.main(sys.argv[1:]) if len(sys.argv) > 1 else 0
try:
    hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
    peak = int(hwm.split()[1]) * 1024
except OSError:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"code": code, "peak": peak}))
"""


def probe(*args) -> dict:
    run = subprocess.run([sys.executable, "-c", PEAK_PROBE, *args], cwd=REPO,
                         capture_output=True, text=True)
    result = json.loads(run.stdout.strip().splitlines()[-1]) if run.stdout.strip() else {}
    if run.returncode or result.get("code"):
        raise SystemExit(run.stderr)
    return result


def peak(work: Path, shard_size: str, extra: list) -> None:
    source = work / "hf"
    if not (source / "config.json").is_file():
        start = time.monotonic()
        synthetic(source)
        print(f"wrote the synthetic checkpoint in {time.monotonic() - start:.0f} s")
    shards = sorted(source.glob("model-*.safetensors"))
    largest = max(p.stat().st_size for p in shards)
    total = sum(p.stat().st_size for p in shards)
    out = work / f"mlx-{shard_size}"
    subprocess.run(["rm", "-rf", str(out), f"{out}.partial"], check=True)
    start = time.monotonic()
    converter = probe("--hf-path", str(source), "--mlx-path", str(out), "--shard-size",
                      shard_size, "--quiet", *extra)["peak"]
    seconds = time.monotonic() - start
    base = probe()["peak"]
    print(f"input: {len(shards)} shards, {total / 1e6:,.0f} MB, largest {largest / 1e6:,.0f} MB;"
          f" output shards of {shard_size} {' '.join(extra)}")
    print(f"peak RSS of the converter: {converter / 1e6:,.0f} MB (interpreter + imports alone:"
          f" {base / 1e6:,.0f} MB; above that {(converter - base) / 1e6:,.0f} MB = "
          f"{(converter - base) / largest:.2f} x the largest input shard); {seconds:.0f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", action="store_true", help="real-model sizes per recipe")
    p.add_argument("--work", type=Path, help="work folder (default: a temporary one)")
    p.add_argument("--shard-size", default="5GB", help="output shard size for the memory run")
    p.add_argument("--convert-args", default="", help="more converter flags for the memory run, "
                   "e.g. '--quant-predicate mixed_3_8'")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        if args.sizes:
            sizes(work)
        else:
            peak(work, args.shard_size, args.convert_args.split())


if __name__ == "__main__":
    main()
