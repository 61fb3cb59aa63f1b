"""One rank of the distributed tests (run under `mlx.launch`, see test_distributed.py), and the
calls it makes, which the tests repeat in one process for the expected values.

    python tests/distributed_worker.py CHECKPOINT SPLIT OUT [--kill-rank R]

SPLIT "tensor" runs tensor parallel (and the `grow` greedy decode too); otherwise a pipeline
split ("auto", "10,26").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

PROMPT_ROWS = 60    # > window (16) x a few: the CED halo is shorter than the prompt
CHUNK = 23          # chunked prefill step (not a multiple of the compression ratio)
DECODE_STEPS = 6
GROW_STEPS = 20     # free-running greedy steps from the `grow` prompt (its exact regime)
GROW_PROMPT = Path(__file__).with_name("data") / "goldens" / "grow" / "prefill" / \
    "inputs.safetensors"


def prompt(checkpoint: Path) -> mx.array:
    ids = mx.load(str(checkpoint.parent / "prefill" / "inputs.safetensors"))["prompt_ids"]
    return ids[None, :PROMPT_ROWS].astype(mx.int32)


def scenario(load, checkpoint: Path, on_step=None) -> dict:
    """Logits of: an exact CED prefill (last row), a full prefill (every row), a chunked CED
    prefill, and greedy decode steps after it (the token every rank agrees on)."""
    out = {}
    model = load("ced")
    ids = prompt(checkpoint)
    out["ced_last"] = model(ids, model.make_cache(), last_only=True)
    out["full_all"] = model(ids, model.make_cache())  # every row: the full strategy
    model.prefill_mode = "full"
    out["full_last"] = model(ids, model.make_cache(), last_only=True)
    model.prefill_mode = "ced"
    cache = model.make_cache()
    logits = model.prefill(ids, cache, step_size=CHUNK)
    out["chunked_last"] = logits
    steps = []
    for step in range(DECODE_STEPS):
        token = model.agree_on_token(mx.argmax(logits[:, -1], axis=-1)[:, None])
        logits = model(token.astype(mx.int32), cache)
        steps.append(logits)
        if on_step is not None:
            on_step(step)
    out["decode"] = mx.concatenate(steps, axis=1)
    mx.eval(out)
    return {k: np.array(v) for k, v in out.items()}


def grow_greedy(model) -> np.ndarray:
    """Greedy tokens after the `grow` golden's 5-token prompt."""
    ids = mx.load(str(GROW_PROMPT))["prompt_ids"][None].astype(mx.int32)
    cache = model.make_cache()
    logits = model(ids, cache, last_only=True)
    tokens = []
    for _ in range(GROW_STEPS):
        token = model.agree_on_token(mx.argmax(logits[:, -1], axis=-1)[:, None])
        tokens.append(token.item())
        logits = model(token.astype(mx.int32), cache)
    return np.array(tokens)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint", help="folder ('{rank}' is replaced by the rank)")
    parser.add_argument("split")
    parser.add_argument("out", type=Path)
    parser.add_argument("--kill-rank", type=int, default=-1,
                        help="this rank kills itself at decode step 2")
    parser.add_argument("--wide", type=Path, default=None,
                        help="tensor parallel: also run the scenario on this checkpoint")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from mlx.utils import tree_flatten
    from mlx_v41.distributed.link import DistributedError
    from mlx_v41.distributed.startup import start_pipeline, start_tensor_parallel

    rank = mx.distributed.init().rank()
    checkpoint = Path(args.checkpoint.format(rank=rank))
    models = {}

    tensor = args.split == "tensor"

    def load(mode):
        if tensor:
            models[mode], _ = start_tensor_parallel(checkpoint, prefill_mode=mode, timeout=20)
        else:
            models[mode], _ = start_pipeline(checkpoint, split=args.split, prefill_mode=mode,
                                             timeout=20)
        return models[mode]

    def on_step(step):
        if rank == args.kill_rank and step == 2:
            os.kill(os.getpid(), 9)

    try:
        values = scenario(load, checkpoint, on_step)
        model = models["ced"]
        link = model.link
        if tensor:
            values["grow"] = grow_greedy(model)
        if args.wide is not None:
            wide = scenario(lambda mode: start_tensor_parallel(args.wide, prefill_mode=mode,
                                                               timeout=20)[0], args.wide)
            values.update({f"wide.{k}": v for k, v in wide.items()})
        sent = {}
        for name, ids in (("prefill", prompt(checkpoint)), ("decode", mx.array([[5]]))):
            before = (link.sent, link.reduced)
            logits = model(ids, models.setdefault("probe", model.make_cache()), last_only=True)
            model.agree_on_token(mx.argmax(logits[:, -1], axis=-1))
            sent[name] = (link.sent - before[0], link.reduced - before[1])
    except DistributedError as e:
        print(e, file=sys.stderr, flush=True)
        return 1
    mx.clear_cache()
    params = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    report = {"active": mx.get_active_memory(), "params": params, "ranges": model.ranges,
              "sent": sent, "rows": PROMPT_ROWS,
              "digest": hashlib.sha256(b"".join(v.tobytes() for v in values.values())).hexdigest()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(report))
    if rank == link.size - 1:  # a pipeline's logits are the last rank's
        np.savez(args.out / "logits.npz", **values)
    return 0


if __name__ == "__main__":
    sys.exit(main())
