"""Tensor parallel against the pipeline and one process, in one run:

* resident weights per rank of the official checkpoint under --tensor-parallel on 2 and 4
  ranks (built from the official config's shapes, nothing allocated; Engram tables are
  memory-mapped and not counted);
* bytes each rank contributes to reductions per decode token and per prefill token at the real
  widths (computed from the shapes) against the pipeline's boundary + logits bytes;
* the same bytes measured on the tiny golden checkpoint (`Link.reduced` / `Link.sent`, by
  tests/distributed_worker.py under mlx.launch);
* tokens/s of `mlx_v41.generate` in one process, 2 tensor-parallel ranks and a 2-rank pipeline
  on the tiny checkpoint (same seed; the texts must agree), the ranks started by each
  --launchers (`mlx.launch`, whose launcher polls its ranks, and `mlx_v41.launch`, whose
  launcher waits; on a machine with few cores the polling takes them from the ranks).

    python -m benchmarks.bench_tensor_parallel [--tokens 12 --repeats 2
        --launchers mlx.launch mlx_v41.launch]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from mlx.utils import tree_flatten  # noqa: E402

from benchmarks.bench_launch import LAUNCHERS  # noqa: E402
from mlx_v41.model.config import ModelArgs, official_config_path  # noqa: E402
from mlx_v41.model.model import Model  # noqa: E402
from mlx_v41.distributed.tensor import TensorParallelModel  # noqa: E402
from mlx_v41.model.schedule import decoder_start  # noqa: E402

TINY = ROOT / "tests" / "data" / "goldens" / "tiny" / "hf"
FP32 = 4
GB = 1e9


def weight_bytes(model) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def official_memory() -> None:
    args = ModelArgs.from_file(official_config_path())
    options = dict(dspark=False, vision=False)
    whole = weight_bytes(Model(args, **options))
    print(f"official checkpoint, resident weights: one process {whole / GB:.1f} GB")
    for size in (2, 4):
        ranks = [weight_bytes(TensorParallelModel(args, SimpleNamespace(rank=r, size=size),
                                                  **options)) for r in range(size)]
        replicated = (size * ranks[0] - whole) / (size - 1)  # each rank: R + (whole - R) / n
        print(f"  tensor parallel x{size}: {ranks[0] / GB:.1f} GB per rank "
              f"({ranks[0] / whole:.3f} of one process; pipeline: {1 / size:.3f}), of which "
              f"{replicated / GB:.2f} GB replicated")


def real_width_bytes() -> None:
    cfg = ModelArgs.from_file(official_config_path()).text_config
    d, layers, encoder = cfg.hidden_size, cfg.num_hidden_layers, decoder_start(cfg)
    per_layer = 3 * d * FP32  # o_b_proj products + [routed, shared] expert sums
    decode = layers * per_layer
    boundary = cfg.hc_mult * d * 2 + cfg.hc_mult * FP32
    token = 4  # the last rank's sampled token (int32), reduced instead of the logits
    print(f"real widths (D {d}, {layers} layers, vocab {cfg.vocab_size}), bytes a rank adds to "
          f"reductions:")
    print(f"  tensor parallel: {per_layer:,} B per layer per row; decode token {decode:,} B; "
          f"CED prefill token {encoder * per_layer:,} B (encoder layers 0-{encoder - 1}; the "
          f"decoder's halo rows add {layers - encoder} x {per_layer:,} B each); full prefill "
          f"token {decode:,} B")
    print(f"  pipeline (2 ranks): boundary {boundary:,} B + token {token} B = "
          f"{boundary + token:,} B per decode token (before sampling on the last rank: + "
          f"{cfg.vocab_size * FP32:,} B of logits); {boundary:,} B per prefill token")
    print(f"  ratio tensor / pipeline per decode token: {decode / (boundary + token):.0f}x; "
          f"{2 * layers} reductions per token against 1 boundary + 1 reduction")


def measured_bytes(out: Path) -> None:
    for split in ("tensor", "auto"):
        folder = out / split
        result = subprocess.run(["mlx.launch", "-n", "2", "--python", sys.executable, "--",
                                 str(ROOT / "tests" / "distributed_worker.py"), str(TINY),
                                 split, str(folder)], capture_output=True, text=True, cwd=ROOT)
        if not (folder / "rank0.json").is_file():
            raise SystemExit(result.stderr)
        report = json.loads((folder / "rank0.json").read_text())
        (p_sent, p_red), (d_sent, d_red) = report["sent"]["prefill"], report["sent"]["decode"]
        rows = report["rows"]
        name = "tensor parallel" if split == "tensor" else "pipeline (split by bytes)"
        print(f"  tiny, {name}, rank 0: CED prefill of {rows} tokens {p_sent + p_red:,} B "
              f"({(p_sent + p_red) / rows:,.0f} B/token: boundary {p_sent:,}, reductions "
              f"{p_red:,}); decode token {d_sent + d_red:,} B (boundary {d_sent:,}, "
              f"reductions {d_red:,})")


STATS = re.compile(r"Prompt: \d+ tokens, ([\d.]+) tokens-per-sec\nGeneration: \d+ tokens, "
                   r"([\d.]+) tokens-per-sec")


def generate(prefix: list, extra: list, tokens: int):
    cmd = prefix + ["-m", "mlx_v41.generate", "--model", str(TINY), "-p", "hello", "-m",
                    str(tokens), "--temp", "0.8", "--seed", "3"] + extra
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT).stdout
    stats = STATS.search(out)
    if stats is None:
        raise SystemExit(f"{' '.join(cmd)}: no statistics in {out!r}")
    return out.split("=" * 10)[1], float(stats[1]), float(stats[2])


def speed(tokens: int, repeats: int, launchers: list) -> None:
    runs = {"1 process": ([sys.executable], [])}
    for name in launchers:
        launch = [*LAUNCHERS[name], "-n", "2", "--python", sys.executable, "--"]
        runs[f"2 ranks tensor, {name}"] = (launch, ["--tensor-parallel"])
        runs[f"2 ranks pipeline, {name}"] = (launch, ["--pipeline"])
    results = {name: [] for name in runs}
    for _ in range(repeats):  # the ways take turns: other load on the machine falls on all
        for name, (prefix, extra) in runs.items():
            results[name].append(generate(prefix, extra, tokens))
    texts = {r[0] for rs in results.values() for r in rs}
    print(f"tokens/s, tiny, {tokens} tokens at temperature 0.8 (texts equal: {len(texts) == 1})")
    base = max(r[2] for r in results["1 process"])
    for name, rs in results.items():
        best = max(r[2] for r in rs)
        print(f"  {name}: prompt {', '.join(f'{r[1]:.0f}' for r in rs)} tok/s, generation "
              f"{', '.join(f'{r[2]:.1f}' for r in rs)} tok/s (best {best / base:.2f}x one process)")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--launchers", nargs="+", choices=list(LAUNCHERS),
                        default=list(LAUNCHERS))
    args = parser.parse_args()
    official_memory()
    real_width_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        measured_bytes(Path(tmp))
    speed(args.tokens, args.repeats, args.launchers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
