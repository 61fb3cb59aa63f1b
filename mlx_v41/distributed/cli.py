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
                        help="seconds to wait for the other ranks at startup, and for progress "
                             "while a prompt or reply runs (default 900)")


def distributed_loader(args):
    """A `load`-like function for args.pipeline or args.tensor_parallel (None: neither);
    silences stdout on ranks other than 0."""
    from .startup import start_pipeline, start_tensor_parallel

    if args.pipeline and args.tensor_parallel:
        raise ValueError("--pipeline and --tensor-parallel do not combine: choose one")
    if not (args.pipeline or args.tensor_parallel):
        return None

    def load(path, **options):
        # The vision tower loads on rank 0: in mlx_v41.generate only for --image, in the chat
        # and the server when the checkpoint has it (as in one process).
        options["vision"] = bool(args.image) if hasattr(args, "image") else None
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
