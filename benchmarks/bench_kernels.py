"""Kernels vs their MLX ops: launch counts and byte counts (anywhere), timings (Metal only).

    python -m benchmarks.bench_kernels              # from the repo root: counts; timings on a Mac
    python -m benchmarks.bench_kernels --repeat 50

Counts: the graph of each op at the real dims (64 heads x 512, window 128 + top-512, ring 256)
is exported with mx.export_to_dot and its primitives are counted. The kernel path is traced
inside mx.export_function, where mx.fast.metal_kernel builds its CustomKernel node without a
GPU. View-only primitives (broadcast, reshape, slice, ...) launch no GPU kernel and are listed
apart. Bytes: the fused attention's access pattern vs a gather-then-attend pipeline of ideal
kernels (each byte of an input read once, each output written once).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import tempfile
import time

import mlx.core as mx

from mlx_v41.kernels import act_fp8 as fp8_mod
from mlx_v41.kernels import fp4_pack as fp4_mod
from mlx_v41.kernels import sparse_attention as attn_mod
from mlx_v41.kernels import swa_ring as ring_mod

HEADS, HEAD_DIM, WINDOW, TOPK, RING, INDEX_DIM = 64, 512, 128, 512, 256, 128
O_WIDTH = 8 * 1024  # o_b_proj's input: 8 output groups x o_lora_rank 1024
CACHE_ROWS = 4096  # compressed rows in the owner's cache (does not change the counts)
VIEW_PRIMITIVES = {"Broadcast", "Reshape", "ExpandDims", "Squeeze", "Slice", "Transpose",
                   "View", "AsStrided", "StopGradient"}


def decode_inputs():
    """One decode token (B = S = 1) of one layer with global attention, real dims."""
    return dict(
        q=mx.zeros((1, 1, HEADS, HEAD_DIM), mx.bfloat16),
        window=mx.zeros((1, WINDOW, HEAD_DIM), mx.bfloat16),
        packed_kv=mx.zeros((1, CACHE_ROWS, attn_mod.packed_row_bytes(HEAD_DIM)), mx.uint8),
        rows=mx.zeros((1, 1, TOPK), mx.int32),
        sinks=mx.zeros((HEADS,), mx.float32),
        ring=mx.zeros((1, RING, HEAD_DIM + HEAD_DIM // 32), mx.uint8),
        kv_row=mx.zeros((1, 1, HEAD_DIM), mx.bfloat16),
        index_row=mx.zeros((1, 1, INDEX_DIM), mx.bfloat16),
        o_products=mx.zeros((1, 1, O_WIDTH), mx.float32),
    )


def op_paths(use_kernel: bool):
    """name -> f(inputs) for the kernels' ops in a decode layer."""
    attend = attn_mod.SPARSE_ATTENTION.build() if use_kernel else attn_mod.sparse_attention_ops
    ring = ring_mod.SWA_RING_UPDATE.build() if use_kernel else ring_mod.swa_ring_update_ops
    pack = fp4_mod.FP4_PACK.build() if use_kernel else fp4_mod.fp4_pack_ops
    fp8 = fp8_mod.ACT_FP8.build() if use_kernel else fp8_mod.act_fp8_ops
    return {
        "sparse_attention": lambda a: attend(a["q"], a["window"], a["packed_kv"], a["rows"],
                                             a["sinks"], HEAD_DIM ** -0.5, WINDOW),
        "swa_ring_update (packed ring)": lambda a: ring(a["ring"], a["kv_row"], 1000),
        "fp4_pack kv row": lambda a: pack(a["kv_row"], "kv"),
        "fp4_pack index row": lambda a: pack(a["index_row"], "index"),
        "act_fp8 kv row": lambda a: fp8(a["kv_row"], mx.bfloat16, False),
        "act_fp8 o_b_proj products": lambda a: fp8(a["o_products"], mx.float32, True),
    }


def count_primitives(fn, inputs: dict) -> collections.Counter:
    """Primitive labels of fn's output graph, traced as mx.export_function does."""
    names = sorted(inputs)
    with tempfile.TemporaryDirectory() as tmp:
        dot = os.path.join(tmp, "graph.dot")

        def traced(*arrays):
            out = fn(dict(zip(names, arrays)))
            mx.export_to_dot(dot, out)
            return out

        try:
            mx.export_function(os.path.join(tmp, "f.mlxfn"), traced, *[inputs[n] for n in names])
        except ValueError as error:  # MLX 0.32 cannot serialise ToFP8 / FromFP8 nodes, but the
            if "serialize" not in str(error) or not os.path.exists(dot):  # graph is written
                raise
        labels = re.findall(r'label ="([^"]+)"', open(dot).read())
    return collections.Counter(label.split()[0] for label in labels)


def print_counts() -> None:
    inputs = decode_inputs()
    print("Graph primitives per decode token (real dims); launches = primitives that are not views")
    print(f"{'op':32s} {'ops: prims':>10s} {'launches':>9s} {'kernel: prims':>14s} "
          f"{'launches':>9s}")
    totals = [0, 0, 0, 0]
    for (name, ops_fn), kernel_fn in zip(op_paths(False).items(), op_paths(True).values()):
        row = []
        for fn in (ops_fn, kernel_fn):
            c = count_primitives(fn, inputs)
            launches = sum(n for p, n in c.items() if p not in VIEW_PRIMITIVES)
            row += [sum(c.values()), launches]
        totals = [t + r for t, r in zip(totals, row)]
        print(f"{name:32s} {row[0]:10d} {row[1]:9d} {row[2]:14d} {row[3]:9d}")
    print(f"{'total':32s} {totals[0]:10d} {totals[1]:9d} {totals[2]:14d} {totals[3]:9d}")


def print_bytes() -> None:
    """Device-memory bytes of one decode token's attention (B = S = 1), from access patterns."""
    q = HEADS * HEAD_DIM * 2
    win = WINDOW * HEAD_DIM * 2
    packed = TOPK * attn_mod.packed_row_bytes(HEAD_DIM)
    idx, sinks, out = TOPK * 4, HEADS * 4, HEADS * HEAD_DIM * 2
    keys_bf16 = (WINDOW + TOPK) * HEAD_DIM * 2
    fused_read = q + win + packed + idx + sinks
    gather_read = idx + packed + win            # gather + dequantise kernel
    attend_read = q + keys_bf16 + (WINDOW + TOPK) + sinks  # attention over bf16 keys + mask
    print("\nBytes per decode token, one layer (window 128 + top-512, 64 heads x 512)")
    print(f"  fused kernel reads  q {q:,} + window {win:,} + packed rows {packed:,} "
          f"(512 x {attn_mod.packed_row_bytes(HEAD_DIM)}) + indices {idx:,} + sinks {sinks:,} "
          f"= {fused_read:,}; writes out {out:,}")
    print(f"  gather-then-attend  gather reads {gather_read:,}, writes bf16 keys {keys_bf16:,} "
          f"(640 x 1024); attend reads {attend_read:,}, writes {out:,}")
    print(f"  reads  {fused_read:,} vs {gather_read + attend_read:,} "
          f"({(gather_read + attend_read) / fused_read:.2f}x); traffic {fused_read + out:,} vs "
          f"{gather_read + attend_read + keys_bf16 + out:,} "
          f"({(gather_read + attend_read + keys_bf16 + out) / (fused_read + out):.2f}x)")


def _time(fn, repeat: int) -> float:
    for _ in range(3):
        mx.eval(fn())
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        mx.eval(fn())
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def print_timings(repeat: int) -> None:
    if not mx.metal.is_available():
        print("\nMetal is unavailable on this machine: kernel timings skipped (run on a Mac).")
        return
    print(f"\nMedian of {repeat} runs, microseconds (kernel vs ops, both through mx.eval)")
    for length, label in ((1, "decode"), (64, "prefill chunk 64")):
        a = decode_inputs()
        a["q"] = mx.random.normal((1, length, HEADS, HEAD_DIM)).astype(mx.bfloat16)
        a["window"] = mx.random.normal((1, WINDOW - 1 + length, HEAD_DIM)).astype(mx.bfloat16)
        a["packed_kv"] = fp4_mod.fp4_pack_ops(mx.random.normal((1, CACHE_ROWS, HEAD_DIM)), "kv")
        a["rows"] = mx.random.randint(0, CACHE_ROWS, (1, length, TOPK)).astype(mx.int32)
        a["kv_row"] = mx.random.normal((1, length, HEAD_DIM)).astype(mx.bfloat16)
        a["index_row"] = mx.random.normal((1, length, INDEX_DIM)).astype(mx.bfloat16)
        a["o_products"] = mx.random.normal((1, length, O_WIDTH))
        mx.eval(a)
        for (name, ops_fn), kernel_fn in zip(op_paths(False).items(), op_paths(True).values()):
            t_ops = _time(lambda: ops_fn(a), repeat)
            t_kernel = _time(lambda: kernel_fn(a), repeat)
            print(f"  {label:17s} {name:32s} kernel {t_kernel:9.1f}  ops {t_ops:9.1f}  "
                  f"({t_ops / t_kernel:.1f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20, help="timed runs per measurement")
    args = parser.parse_args()
    print_counts()
    print_bytes()
    print_timings(args.repeat)


if __name__ == "__main__":
    main()
