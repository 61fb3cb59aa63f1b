"""`--pipeline` and `--tensor-parallel` for the CLIs: every rank loads its share of its own
local copy of the folder, rank 0 alone prints (the others' stdout goes nowhere; their errors
still reach stderr)."""

from __future__ import annotations

import os
import sys


def add_distributed_arguments(parser) -> None:
    parser.add_argument("--pipeline", nargs="?", const="auto", default=None, metavar="SPLIT",
                        help="pipeline parallel over the ranks mlx.launch started: layers split "
                             "by weight bytes, or SPLIT = the first layer of each rank after "
                             "rank 0 (e.g. 20, or 10,26 for three ranks)")
    parser.add_argument("--tensor-parallel", action="store_true",
                        help="tensor parallel over the ranks mlx.launch started: every layer's "
                             "attention heads and experts split over the ranks")
    parser.add_argument("--distributed-timeout", type=float, default=None, metavar="S",
                        help="seconds to wait for the other ranks at startup (default 900)")


def distributed_loader(args, drafts: bool = False):
    """A `load`-like function for args.pipeline or args.tensor_parallel (None: neither);
    silences stdout on ranks other than 0. `drafts`: the caller runs greedy DSpark across a
    pipeline (`mlx_v41.generate`); the others refuse `--dspark`."""
    from .startup import start_pipeline, start_tensor_parallel

    switch = "--pipeline" if args.pipeline else "--tensor-parallel"
    if args.pipeline and args.tensor_parallel:
        raise ValueError("--pipeline and --tensor-parallel do not combine: choose one")
    if not (args.pipeline or args.tensor_parallel):
        return None

    def load(path, **options):
        drafting = drafts and bool(args.pipeline)
        if options.get("dspark") and not drafting:
            where = "only in mlx_v41.generate, greedily" if args.pipeline else "yet"
            raise ValueError(f"{switch} runs the DSpark drafter {where} (drop --dspark)")
        if not drafting:
            options.pop("dspark", None)
        # The vision tower loads on rank 0 of a pipeline, and only for --image (chat and the
        # server refuse images across ranks).
        options["vision"] = bool(getattr(args, "image", None)) and bool(args.pipeline)
        if args.pipeline:
            model, tokenizer = start_pipeline(path, split=args.pipeline,
                                              timeout=args.distributed_timeout, **options)
        else:
            model, tokenizer = start_tensor_parallel(path, timeout=args.distributed_timeout,
                                                     **options)
        _same_seed(model.link, args.seed)
        if model.link.rank != 0:
            sys.stdout = open(os.devnull, "w")
        return model, tokenizer

    return load


def _same_seed(link, seed) -> None:
    """Without --seed, every rank samples with rank 0's random seed: the ranks feed their
    own sampled token to their Engram hashing, so they must sample alike."""
    import mlx.core as mx

    if seed is None:  # with --seed every rank already holds the key one process would
        mine = mx.array([int.from_bytes(os.urandom(4), "little") >> 1], mx.int32)
        mx.random.seed(int(link.all_gather(mine, "agreeing on a seed")[0].item()))
