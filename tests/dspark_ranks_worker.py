"""One rank of the DSpark-across-ranks tests (run under `mlx.launch`, see
test_distributed.py), and the call the tests repeat in one process.

    python tests/dspark_ranks_worker.py CHECKPOINT SPLIT OUT [--truth T,T,.. --right R]

SPLIT "tensor" runs tensor parallel (every rank drafts), otherwise a pipeline split.

Runs greedy DSpark with the model's drafter, then (with `--truth`, the plain greedy
continuation) again with the drafting rank(s) using `test_dspark.Oracle`, right about R drafts a
cycle, so drafts are accepted (the tiny drafter's are not greedily); and sampled with the
model's drafter (`SAMPLED`, seed `SEED`). Each run ends with a draw that shows the random state.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import hashlib

import mlx.core as mx
import numpy as np

STEPS = 14
SEED = 5
SAMPLED = dict(temp=1.0)  # measured on tiny: 4 of the drafter's drafts kept in 10 cycles


def greedy_dspark(model, ids: mx.array, truth=None, right: int = 5, sampled: bool = False,
                  group=None) -> dict:
    """DSpark decoding (greedy, or `SAMPLED` from `SEED`) by the processes of `group` (None:
    one): its tokens, drafts accepted, every cache entry's offset, a digest of the rows the
    drafter's rings hold (where it runs), and a draw of the random state after the run."""
    from mlx_v41.generation.group import ONE_PROCESS
    from mlx_v41.generation.speculative import DraftStats, Sampling, speculative_steps
    from test_dspark import Oracle

    group = ONE_PROCESS if group is None else group
    drafter = None if truth is None or "dspark" not in model else \
        Oracle(model, ids[0].tolist(), truth, right)
    cache = model.make_cache()
    logits = model(ids, cache, last_only=True)
    stats = DraftStats()
    mx.random.seed(SEED)
    sampling = Sampling(**SAMPLED) if sampled else Sampling()
    tokens = [int(t) for t, _, _ in speculative_steps(model, logits, cache, sampling=sampling,
                                                      max_tokens=STEPS, stats=stats,
                                                      drafter=drafter, group=group)]
    state = mx.random.randint(0, 2 ** 31 - 1, (2,)).tolist()
    rings = b""
    if "dspark" in model:
        for ring in cache[model.cfg.num_hidden_layers:]:
            keys = model.dspark.ring_keys(ring, ring.offset).astype(mx.float32)
            rings += np.array(keys).tobytes()
    return {"tokens": tokens, "accepted": stats.accepted, "cycles": stats.cycles,
            "offsets": [c.offset for c in cache], "rings": hashlib.sha256(rings).hexdigest(),
            "state": state}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("split")
    parser.add_argument("out", type=Path)
    parser.add_argument("--truth", default=None)
    parser.add_argument("--right", type=int, default=5)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from mlx_v41.distributed.startup import start_pipeline, start_tensor_parallel
    from distributed_worker import prompt

    if args.split == "tensor":
        model, _ = start_tensor_parallel(args.checkpoint, dspark=True, timeout=20)
    else:
        model, _ = start_pipeline(args.checkpoint, split=args.split, dspark=True, timeout=20)
    ids = prompt(Path(args.checkpoint))
    report = {"drafter": greedy_dspark(model, ids, group=model.group),
              "sampled": greedy_dspark(model, ids, sampled=True, group=model.group)}
    if args.truth is not None:
        truth = [int(t) for t in args.truth.split(",")]
        report["oracle"] = greedy_dspark(model, ids, truth, args.right, group=model.group)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{model.link.rank}.json").write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
