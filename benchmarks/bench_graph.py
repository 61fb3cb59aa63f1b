"""Graph size of one decode token: non-view primitives per token and per layer, ours vs mlx-lm.

On a Mac a decode step of this model is bound by how many kernels it launches, and on MLX's CPU
backend by how many ops it runs (~8 us each), so the graph of one step is the quantity to cut.
One run writes a random checkpoint in the published layout (tests/checkpoint_factory.py, the
same one bench_vs_mlx_lm.py times: the published 40 + 3 layer schedule at hidden 128, no
Engram), prefills the same prompt into both models and traces one decode step:

* ops path: the graph of the step's logits and every cache array it updates, exported with
  `mx.export_to_dot` (compiled regions as the `Compiled...` nodes `mx.compile` fused), for
  mlx_v41 on its reference ops and for mlx-lm's `deepseek_v41`;
* CPU default: mlx_v41 as it runs on the CPU, where a decode token's mHC Sinkhorn runs in
  NumPy after its mixes are evaluated (kernels/mhc.py `sinkhorn_host`, the same bits): the
  MLX launches (traced with a lazy stand-in for the NumPy step, so the step stays one graph)
  and the host round trips per token;
* Metal path: mlx_v41 with every kernel one launch (`Kernels.build`: sparse attention, SWA
  ring, FP4 pack, mHC, act_fp8): the kernels are built through their builders with a
  stand-in `metal_kernel` factory whose launch is one `Depends` node over the kernel's inputs
  (benchmarks/bench_kernels.py traces real `CustomKernel` nodes inside `mx.export_function`,
  but under that tracing `mx.compile` does not fuse, so a whole step traced there would count
  every fused op apart).

A primitive that is a view (broadcast, reshape, slice, split, ...) launches nothing and is not
counted; a `Compiled...` node (an `mx.compile` fusion) is one launch. Per layer = per token /
layers. The graph nodes with the views are printed too: on MLX's CPU backend every node, a view
included, costs a few microseconds of scheduling.

With --batch B...: launches of one batched decode step (`batch_forward`, the second of two) at
each B, on the Metal path (the counting factory's kernels), the ops path and the CPU default
("host": the ops, a few tokens' Sinkhorn in NumPy, as above), for B sequences
whose windows are full (lengths from the window to --prompt) and for a mix with windows still
filling (lengths from 1).

    python -m benchmarks.bench_graph [--prompt 256 --window 32 --index-topk 128 --top 12]
    python -m benchmarks.bench_graph --batch 1 8 32
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # run from a checkout; the factory is a test helper

from benchmarks.bench_kernels import VIEW_PRIMITIVES  # noqa: E402
from benchmarks.bench_vs_mlx_lm import (PUBLISHED_POOL, VOCAB, cache_arrays,  # noqa: E402
                                        load_mlx_lm, prefill)
from checkpoint_factory import schedule_text_config, write_checkpoint  # noqa: E402

VIEWS = VIEW_PRIMITIVES | {"Flatten", "Unflatten", "Split"}  # views under other names


def graph_counts(outputs: list) -> collections.Counter:
    """Primitive labels of the graph of `outputs` (each launch once per occurrence)."""
    with tempfile.TemporaryDirectory() as tmp:
        dot = os.path.join(tmp, "step.dot")
        mx.export_to_dot(dot, *outputs)
        labels = re.findall(r'label ="([^"]+)"', Path(dot).read_text())
    counts = collections.Counter(label.split()[0] for label in labels)
    counts["CustomKernel"] = counts.pop("Depends", 0)
    return +counts


def step_graph(call, cache, token: mx.array) -> collections.Counter:
    """One decode step: its logits and every cache array after it (the arrays the step did
    not touch are evaluated leaves and add nothing)."""
    logits = call(token, cache)
    return graph_counts([logits, *cache_arrays(cache)])


def counting_kernel(**_):
    """A stand-in for `mx.fast.metal_kernel`: each launch is one `Depends` node that ties the
    kernel's array inputs to zero outputs of the declared shapes (the values are not used)."""
    def launch(*, inputs, output_shapes, output_dtypes, **__):
        outs = [mx.zeros(shape, dtype) for shape, dtype in zip(output_shapes, output_dtypes)]
        mx.eval(outs)
        return mx.depends(outs, [a for a in inputs if isinstance(a, mx.array)])
    return launch


def launches(counts: collections.Counter) -> collections.Counter:
    return collections.Counter({p: n for p, n in counts.items() if p not in VIEWS})


def load_ours(folder: Path, path: str):
    """mlx_v41 on the "ops" (all in MLX), "host" (the CPU's default) or "metal" path."""
    import mlx_v41
    from mlx_v41.kernels import Kernels

    model = mlx_v41.load_model(folder)
    model.kernels = Kernels.build(counting_kernel, inexact=True) if path == "metal" \
        else Kernels(use=False, host_sinkhorn=path == "host")
    return lambda x, c: model(x, cache=c, last_only=True), model.make_cache


class LazyHostSinkhorn:
    """Stands in for `sinkhorn_host` while a step is traced: counts the round trips and
    returns its input unevaluated (the NumPy step launches nothing in MLX)."""

    def __init__(self):
        import mlx_v41.numerics.mhc as module

        self.module, self.real, self.calls = module, module.sinkhorn_host, 0

    def __enter__(self):
        def lazy(comb, iters, eps):
            self.calls += 1
            return comb

        self.module.sinkhorn_host = lazy
        return self

    def __exit__(self, *exc):
        self.module.sinkhorn_host = self.real


def measure(name: str, load, ids: mx.array, token: mx.array, layers: int, top: int,
            host: bool = False) -> int:
    call, make_cache = load()
    cache = prefill(call, make_cache, ids, 512)
    if host:
        with LazyHostSinkhorn() as stand_in:
            graph = step_graph(call, cache, token)
        trips = f", {stand_in.calls} NumPy Sinkhorns"
    else:
        graph, trips = step_graph(call, cache, token), ""
    counts = launches(graph)
    total, nodes = sum(counts.values()), sum(graph.values())
    print(f"{name:22s} {total:7,d} launches per token, {total / layers:6.1f} per layer "
          f"({nodes:,d} graph nodes with the views{trips})")
    print("    " + ", ".join(f"{p} {n}" for p, n in counts.most_common(top)))
    return total


def batch_launches(folder: Path, path: str, sizes: list, lengths: list, rng) -> dict:
    """Launches of one batched decode step (`batch_forward`) of the first B sequences, per B:
    each sequence prefilled alone to its length, one batched step run, then the next one
    counted (the steady state of a batch: its rings stay stacked from the first step on; the
    cache arrays the step writes are counted with its logits)."""
    import mlx_v41
    from mlx_v41.model.batch import batch_forward

    call, make_cache = load_ours(folder, path)
    model = make_cache.__self__  # the loaded model (its bound make_cache)
    caches = []
    for length in lengths[:max(sizes)]:
        ids = mx.array(rng.integers(3, VOCAB, (1, length)), dtype=mx.int32)
        caches.append(prefill(call, make_cache, ids, 512))
    out = {}
    for b in sizes:
        step = [mlx_v41.copy_cache(c) for c in caches[:b]]
        ids = mx.array(rng.integers(3, VOCAB, (b, 1)), dtype=mx.int32)
        mx.eval(batch_forward(model, ids, step).logits, [cache_arrays(c) for c in step])
        with LazyHostSinkhorn() if path == "host" else contextlib.nullcontext():
            logits = batch_forward(model, ids, step).logits
            graph = graph_counts([logits, *[a for c in step for a in cache_arrays(c)]])
        out[b] = sum(launches(graph).values())
    return out


def batch_table(folder: Path, sizes: list, window: int, prompt: int, paths: tuple) -> None:
    """Launches per batched step at each B, Metal path and ops path, for sequences whose
    windows are all full and for a mix with windows still filling."""
    rng = np.random.default_rng(1)
    full = [int(x) for x in np.linspace(window, prompt, max(sizes))]
    mixed = [int(x) for x in np.linspace(1, prompt, max(sizes))]  # some below the window
    print(f"\nlaunches per batched decode step (one `batch_forward`), window {window}:")
    print("| sequences | path | " + " | ".join(f"B = {b}" for b in sizes) +
          " | " + " | ".join(f"B = {b} / B = 1" for b in sizes if b > 1) + " |")
    print("|---|---|" + "---|" * (2 * len(sizes) - 1))
    for name, lengths in ((f"windows full ({full[0]}-{full[-1]} tokens)", full),
                          (f"mixed ({mixed[0]}-{mixed[-1]} tokens, "
                           f"{sum(n < window for n in mixed[:max(sizes)])} filling)", mixed)):
        for path in paths:
            counts = batch_launches(folder, path, sizes, lengths, rng)
            ratios = [f"{counts[b] / counts[sizes[0]]:.2f}x" for b in sizes if b > 1]
            print(f"| {name} | {path} | " + " | ".join(f"{counts[b]:,}" for b in sizes) +
                  " | " + " | ".join(ratios) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens before the step")
    parser.add_argument("--window", type=int, default=32, help="sliding_window (published 128)")
    parser.add_argument("--index-topk", type=int, default=128, help="index_topk (published 512)")
    parser.add_argument("--top", type=int, default=12, help="primitives listed per model")
    parser.add_argument("--stack-on-ops-only", action="store_true",
                        help="with --batch: the Metal path as before the kernels took per-row "
                        "positions (each sequence attends alone where a kernel runs)")
    parser.add_argument("--batch", type=int, nargs="+", metavar="B",
                        help="instead, launches per batched decode step at these B (the first "
                        "1), e.g. 1 8 32")
    args = parser.parse_args()
    config = {**schedule_text_config(), **PUBLISHED_POOL, "vocab_size": VOCAB,
              "sliding_window": args.window, "index_topk": args.index_topk}
    rng = np.random.default_rng(0)
    ids = mx.array(rng.integers(3, VOCAB, (1, args.prompt)), dtype=mx.int32)
    token = mx.array([[int(rng.integers(3, VOCAB))]], dtype=mx.int32)
    layers = config["num_hidden_layers"]
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(Path(tmp), config, engram=False)
        if args.batch:
            from mlx_v41.model.attention import Attention

            Attention.stack_on_ops_only = args.stack_on_ops_only
            paths = ("metal",) if args.stack_on_ops_only else ("metal", "ops", "host")
            return batch_table(Path(tmp), args.batch, args.window, args.prompt, paths)
        print(f"one decode step after {args.prompt} prompt tokens, {layers} layers, "
              f"mlx {mx.__version__}")
        ours = measure("mlx_v41 (ops)", lambda: load_ours(Path(tmp), "ops"), ids, token,
                       layers, args.top)
        host = measure("mlx_v41 (CPU default)", lambda: load_ours(Path(tmp), "host"), ids,
                       token, layers, args.top, host=True)
        metal = measure("mlx_v41 (Metal path)", lambda: load_ours(Path(tmp), "metal"), ids,
                        token, layers, args.top)
        theirs = measure("mlx-lm deepseek_v41", lambda: load_mlx_lm(Path(tmp)), ids, token,
                         layers, args.top)
    print(f"ratio mlx-lm / mlx_v41: ops {theirs / ours:.2f}x, CPU default {theirs / host:.2f}x, "
          f"Metal path {theirs / metal:.2f}x")


if __name__ == "__main__":
    main()
