"""One rank of the distributed tests (run under `mlx.launch`, see test_distributed.py), and the
calls it makes, which the tests repeat in one process for the expected values.

    python tests/distributed_worker.py CHECKPOINT SPLIT OUT [--kill-rank R] [--image PNG]

SPLIT "tensor" runs tensor parallel (and the `grow` greedy decode too); otherwise a pipeline
split ("auto", "10,26"). With --image, only the image prompt's scenario (`image_scenario`).
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


def one_process():
    from mlx_v41.generation.group import ONE_PROCESS

    return ONE_PROCESS


def scenario(load, checkpoint: Path, on_step=None, is_group: bool = False) -> dict:
    """Logits of: an exact CED prefill (last row), a full prefill (every row), a chunked CED
    prefill, and greedy decode steps after it (the token every rank agrees on; `is_group`:
    `load` makes a group model, whose ranks agree through `model.group`)."""
    out = {}
    model = load("ced")
    group = model.group if is_group else one_process()
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
        token = group.agree_on_token(mx.argmax(logits[:, -1], axis=-1)[:, None])
        logits = model(token.astype(mx.int32), cache)
        steps.append(logits)
        if on_step is not None:
            on_step(step)
    out["decode"] = mx.concatenate(steps, axis=1)
    mx.eval(out)
    return {k: np.array(v) for k, v in out.items()}


IMAGE_CHUNK = 7  # puts chunk boundaries inside the image span


def image_scenario(model, images, group=None) -> dict:
    """Logits of an image prompt (the vision golden's ids, one placeholder): a full prefill
    (every row), a chunked CED prefill and greedy decode steps after it; and the bytes rank 0
    sends for the full prefill with and without the images, and its all_sum bytes sharing the
    prompt and the first call's image rows. `group`: a group model's (None: one process)."""
    from vision_fixtures import prompt_before_expansion

    link = None if group is None else group.link
    group = one_process() if group is None else group
    before = link.reduced if link else 0
    prompt = group.prepare_prompt(model, prompt_before_expansion(), images)
    inputs = prompt.inputs(model)
    out, sent = {}, {"image_shared": (link.reduced if link else 0) - before}
    ids = mx.array([prompt.ids], mx.int32)
    for name, given in (("image_full_all", inputs), ("text_full_all", None)):
        before = link.sent if link else 0
        out[name] = model(ids, model.make_cache(), images=given)
        mx.eval(out[name])
        sent[name] = (link.sent if link else 0) - before
    cache = model.make_cache()
    logits = model.prefill(ids, cache, step_size=IMAGE_CHUNK, images=prompt.inputs(model))
    out["image_chunked_last"] = logits
    steps = []
    for _ in range(DECODE_STEPS // 2):
        token = mx.argmax(logits[:, -1], axis=-1)[:, None]
        token = group.agree_on_token(token)
        logits = model(token.astype(mx.int32), cache)
        steps.append(logits)
    out["image_decode"] = mx.concatenate(steps, axis=1)
    mx.eval(out)
    values = {k: np.array(v) for k, v in out.items()}
    values["rows"] = np.array(len(prompt.ids))
    values["records"] = np.array(json.dumps(prompt.records()))  # rank 0's, on every rank
    return values, sent


def generate_args(checkpoint, images) -> list:
    """`mlx_v41.generate` with images (seeded sampling); the test runs it in one process."""
    return ["--model", str(checkpoint), "-p", "Which is red?", "--image", *map(str, images),
            "-m", "6", "--temp", "0.8", "--seed", "3"]


def grow_greedy(model, group=None) -> np.ndarray:
    """Greedy tokens after the `grow` golden's 5-token prompt (`group`: a group model's)."""
    group = one_process() if group is None else group
    ids = mx.load(str(GROW_PROMPT))["prompt_ids"][None].astype(mx.int32)
    cache = model.make_cache()
    logits = model(ids, cache, last_only=True)
    tokens = []
    for _ in range(GROW_STEPS):
        token = group.agree_on_token(mx.argmax(logits[:, -1], axis=-1)[:, None])
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
    parser.add_argument("--image", action="append", default=None,
                        help="run the image prompt scenario only (repeatable)")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(1, str(Path(__file__).resolve().parent))
    from mlx.utils import tree_flatten
    from mlx_v41.distributed.link import DistributedError
    from mlx_v41.distributed.startup import start_pipeline, start_tensor_parallel

    rank = mx.distributed.init().rank()
    checkpoint = Path(args.checkpoint.format(rank=rank))
    models = {}

    tensor = args.split == "tensor"

    def load(mode, **options):
        if tensor:
            models[mode], _ = start_tensor_parallel(checkpoint, prefill_mode=mode, timeout=20,
                                                    **options)
        else:
            models[mode], _ = start_pipeline(checkpoint, split=args.split, prefill_mode=mode,
                                             timeout=20, **options)
        return models[mode]

    def on_step(step):
        if rank == args.kill_rank and step == 2:
            os.kill(os.getpid(), 9)

    if args.image is not None:
        try:
            model = load("ced", vision=True)
            values, sent = image_scenario(model, args.image, model.group)
        except DistributedError as e:
            print(e, file=sys.stderr, flush=True)
            return 1
        import contextlib
        import io
        from mlx_v41.cli.generate import main as generate_main
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            mode = ["--tensor-parallel"] if tensor else ["--pipeline", args.split]
            code = generate_main(generate_args(checkpoint, args.image) + mode)
        args.out.mkdir(parents=True, exist_ok=True)
        report = {"ranges": model.ranges, "sent": sent, "vision": "vision" in model,
                  "generate": [code, text.getvalue()]}
        (args.out / f"rank{rank}.json").write_text(json.dumps(report))
        if rank == model.link.size - 1:
            np.savez(args.out / "logits.npz", **values)
        return 0
    try:
        values = scenario(load, checkpoint, on_step, is_group=True)
        model = models["ced"]
        link = model.link
        if tensor:
            values["grow"] = grow_greedy(model, model.group)
        if args.wide is not None:
            wide = scenario(lambda mode: start_tensor_parallel(args.wide, prefill_mode=mode,
                                                               timeout=20)[0], args.wide,
                            is_group=True)
            values.update({f"wide.{k}": v for k, v in wide.items()})
        sent = {}
        for name, ids in (("prefill", prompt(checkpoint)), ("decode", mx.array([[5]]))):
            before = (link.sent, link.reduced)
            logits = model(ids, models.setdefault("probe", model.make_cache()), last_only=True)
            model.group.agree_on_token(mx.argmax(logits[:, -1], axis=-1))
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
