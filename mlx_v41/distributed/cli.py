"""`--pipeline` for the CLIs: every rank loads its share of its own local copy of the folder,
rank 0 alone prints (the others' stdout goes nowhere; their errors still reach stderr)."""

from __future__ import annotations

import os
import sys


def add_distributed_arguments(parser) -> None:
    parser.add_argument("--pipeline", nargs="?", const="auto", default=None, metavar="SPLIT",
                        help="pipeline parallel over the ranks mlx.launch started: layers split "
                             "by weight bytes, or SPLIT = the first layer of each rank after "
                             "rank 0 (e.g. 20, or 10,26 for three ranks)")
    parser.add_argument("--distributed-timeout", type=float, default=None, metavar="S",
                        help="seconds to wait for the other ranks at startup (default 900)")


def pipeline_loader(args):
    """A `load`-like function for args.pipeline; silences stdout on ranks other than 0."""
    from .startup import start_pipeline

    if getattr(args, "prompt_cache_file", None):
        raise ValueError("--prompt-cache-file is not supported with --pipeline yet")

    def load(path, **options):
        if options.get("dspark"):
            raise ValueError("--pipeline does not run the DSpark drafter yet (drop --dspark)")
        options.pop("dspark", None)
        model, tokenizer = start_pipeline(path, split=args.pipeline,
                                          timeout=args.distributed_timeout, **options)
        _same_seed(model.stage.link, args.seed)
        if model.stage.rank != 0:
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
