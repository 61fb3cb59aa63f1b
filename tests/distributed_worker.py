"""One rank of the distributed tests (run under `mlx.launch`, see test_distributed.py), and the
calls it makes, which the tests repeat in one process for the expected values.

    python tests/distributed_worker.py CHECKPOINT SPLIT OUT [--kill-rank R --kill-after N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

PROMPT_ROWS = 60    # > window (16) x a few: the CED halo is shorter than the prompt
CHUNK = 23          # chunked prefill step (not a multiple of the compression ratio)
DECODE_STEPS = 6


def prompt(checkpoint: Path) -> mx.array:
    ids = mx.load(str(checkpoint.parent / "prefill" / "inputs.safetensors"))["prompt_ids"]
    return ids[None, :PROMPT_ROWS].astype(mx.int32)


def scenario(load, checkpoint: Path, on_step=None) -> dict:
    """Logits of: an exact CED prefill (last row), a full prefill (every row), a chunked CED
    prefill, and greedy decode steps after it."""
    ids = prompt(checkpoint)
    out = {}
    model = load("ced")
    out["ced_last"] = model(ids, model.make_cache(), last_only=True)
    full = load("full")
    out["full_all"] = full(ids, full.make_cache())
    out["full_last"] = full(ids, full.make_cache(), last_only=True)
    cache = model.make_cache()
    logits = model.prefill(ids, cache, step_size=CHUNK)
    out["chunked_last"] = logits
    steps = []
    for step in range(DECODE_STEPS):
        token = mx.argmax(logits[:, -1], axis=-1)[:, None].astype(mx.int32)
        logits = model(token, cache)
        steps.append(logits)
        if on_step is not None:
            on_step(step)
    out["decode"] = mx.concatenate(steps, axis=1)
    mx.eval(out)
    return {k: np.array(v) for k, v in out.items()}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("split")
    parser.add_argument("out", type=Path)
    parser.add_argument("--kill-rank", type=int, default=-1)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from mlx_v41.distributed.startup import start_pipeline

    def load(mode):
        model, _ = start_pipeline(args.checkpoint, split=args.split, prefill_mode=mode)
        return model

    rank = mx.distributed.init().rank()

    def on_step(step):
        if rank == args.kill_rank and step == 2:
            os.kill(os.getpid(), 9)

    memory = {}
    mx.reset_peak_memory()
    values = scenario(load, args.checkpoint, on_step)
    model = load("ced")
    memory = {"active": mx.get_active_memory(), "ranges": model.ranges,
              "sent": model.stage.link.sent}
    probe = model.make_cache()
    link = model.stage.link
    before = (link.sent, link.reduced)
    model(prompt(args.checkpoint), probe, last_only=True)
    prefill = (link.sent - before[0], link.reduced - before[1])
    before = (link.sent, link.reduced)
    model(mx.array([[5]]), probe)
    decode = (link.sent - before[0], link.reduced - before[1])
    memory.update(prefill_sent=prefill, decode_sent=decode, rows=PROMPT_ROWS)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(memory))
    if rank == 0:
        np.savez(args.out / "logits.npz", **values)
    return 0


if __name__ == "__main__":
    sys.exit(main())
