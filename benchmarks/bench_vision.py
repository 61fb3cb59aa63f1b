"""ViT + aligner time and peak memory for the largest image the preprocessing allows, at
reduced widths on this machine, with the numbers to extrapolate to the real tower.

The largest image (by patches) is an extreme panorama: 42882 x 42 after the plan, a 3 x 3063
patch grid (9,189 patches) whose 1 x 1021 cells fill the 1,024-position span. A block is timed
at two widths with the real head dim (64): its cost is `a * n * D^2` (linears) plus
`b * n^2 * D` (attention), so two widths give a and b. Peak memory is measured per run above the
resident weights, with the default query blocking and with one attention call over all rows
(the peer: what an unblocked port allocates).

    python benchmarks/bench_vision.py [--widths 64 128] [--layers 1]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from mlx_v41.model.config import VisionConfig  # noqa: E402
from mlx_v41.model.vision import Aligner, VisionTransformer, plan_image_grid  # noqa: E402

HEAD_DIM = 64
REAL = VisionConfig()
TEXT_HIDDEN = 5120


def random_module(module, seed: int):
    """Small random BF16 weights (the values do not change the cost)."""
    keys = mx.random.split(mx.random.key(seed), len(tree_flatten(module.parameters())))
    params = [(name, (0.02 * mx.random.normal(p.shape, key=keys[i])).astype(p.dtype))
              for i, (name, p) in enumerate(tree_flatten(module.parameters()))]
    module.update(tree_unflatten(params))
    mx.eval(module.parameters())
    return module


def measure(fn, *args) -> tuple:
    """(seconds, peak bytes above what was allocated before) of one evaluated call."""
    mx.eval(args)
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    tic = time.perf_counter()
    mx.eval(fn(*args))
    return time.perf_counter() - tic, mx.get_peak_memory() - base


def tower(width: int, layers: int, hidden: int):
    cfg = VisionConfig(num_hidden_layers=layers, hidden_size=width,
                       num_attention_heads=width // HEAD_DIM,
                       intermediate_size=REAL.intermediate_size * width // REAL.hidden_size)
    vit = random_module(VisionTransformer(cfg), 0)
    aligner = random_module(Aligner(width, cfg.downsample_ratio, hidden), 1)
    return cfg, vit, aligner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs=2, default=[64, 128])
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--text-hidden", type=int, default=512)
    args = parser.parse_args()
    grid = plan_image_grid(100000, 10, REAL)
    n = grid.vit_h * grid.vit_w
    print(f"largest image: grid {grid.vit_h} x {grid.vit_w} = {n} patches, {grid.llm_h} x "
          f"{grid.llm_w} cells, span {grid.span_tokens}")
    patches = (0.5 * mx.random.normal((n, 3 * REAL.patch_size ** 2))).astype(mx.bfloat16)
    block_times = {}
    for width in args.widths:
        cfg, vit, aligner = tower(width, args.layers, args.text_hidden)
        weights = sum(p.nbytes for _, p in tree_flatten([vit.parameters(),
                                                          aligner.parameters()]))
        seconds, peak = measure(lambda x: vit(x, grid.vit_h, grid.vit_w), patches)
        features = vit(patches, grid.vit_h, grid.vit_w)
        a_seconds, a_peak = measure(lambda f: aligner(f, grid.vit_h, grid.vit_w), features)
        one_seconds, one_peak = measure(lambda x: vit(x, grid.vit_h, grid.vit_w, block=n),
                                        patches)
        block_times[width] = seconds / args.layers
        print(f"width {width} ({cfg.num_attention_heads} heads), {args.layers} block(s): ViT "
              f"{seconds:.2f} s, peak {peak / 2**20:.0f} MiB above {weights / 2**20:.1f} MiB "
              f"weights; one attention call: {one_seconds:.2f} s, peak {one_peak / 2**20:.0f} "
              f"MiB; aligner to {args.text_hidden}: {a_seconds:.3f} s, peak "
              f"{a_peak / 2**20:.0f} MiB")
    (d1, t1), (d2, t2) = sorted(block_times.items())
    # t = a n D^2 + b n^2 D  ->  t / D = a n D + b n^2: a line in D
    slope = (t2 / d2 - t1 / d1) / (d2 - d1)
    lin, att = slope * d1 * d1, t1 - slope * d1 * d1
    real = REAL.hidden_size
    per_block = slope * real * real + (t1 / d1 - slope * d1) * real
    print(f"per block at width {d1}: linears {lin:.2f} s, attention {att:.2f} s; "
          f"extrapolated per block at {real}: {per_block:.1f} s, "
          f"{REAL.num_hidden_layers} blocks: {per_block * REAL.num_hidden_layers:.0f} s")


if __name__ == "__main__":
    main()
