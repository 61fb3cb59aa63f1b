"""`mlx_v41.demo`: every stage of the pipeline on a tiny random checkpoint, in seconds.

    mlx_v41.demo                       # or: mlx_v41.generate --model demo -p "Hello"

The checkpoint is built once (mlx_v41.checkpoint.demo); the stages are the real load, chat
format, prefill, decode, cache reuse and byte counts.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from ..checkpoint.demo import ensure_demo_checkpoint
from .args import ArgumentParser, _number, run_command, utf8_flag

DEFAULT_PROMPT = "Hello! What is two plus two?"
DEFAULT_MAX_TOKENS = 16


def _stage(number: int, text: str) -> None:
    print(f"[{number}] {text}", flush=True)


def run_demo(prompt: str, max_tokens: int, folder: Optional[Path], rebuild: bool) -> None:
    import mlx.core as mx

    from ..cache.layer import cache_bytes
    from ..chat.session import ChatSession
    from ..checkpoint.source import load
    from ..generation.api import print_stats

    print("mlx_v41 demo: a tiny random checkpoint, so the text below is random; every stage "
          "is the real pipeline.")
    tic = time.perf_counter()
    folder = ensure_demo_checkpoint(folder, rebuild)
    size = sum(f.stat().st_size for f in folder.iterdir())
    _stage(1, f"checkpoint: {folder} ({size / 2**20:.1f} MiB, published layout) "
              f"in {time.perf_counter() - tic:.1f} s")
    tic = time.perf_counter()
    model, tokenizer = load(folder)
    cfg = model.args.text_config
    _stage(2, f"load: {cfg.num_hidden_layers} + {cfg.num_nextn_predict_layers} layers, hidden "
              f"{cfg.hidden_size}, vocabulary {cfg.vocab_size}, "
              f"in {time.perf_counter() - tic:.1f} s")
    mx.random.seed(0)
    session = ChatSession(model, tokenizer, thinking=False, max_tokens=max_tokens)
    tokens = tokenizer.encode_chat(session.conversation() + [{"role": "user", "content": prompt}],
                                   thinking=False)
    _stage(3, f"chat format: {tokenizer.decode(tokens)!r} -> {len(tokens)} tokens")
    _stage(4, "prefill + decode (greedy):")
    response = None
    for response in session.reply(prompt):
        print(response.text, end="", flush=True)
    print()
    print_stats(response)
    follow_up = "And then?"
    for response in session.reply(follow_up):
        pass
    s = session.stats
    _stage(5, f"second turn {follow_up!r}: prompt {s.prompt_tokens} tokens, {s.reused_tokens} "
              f"reused from the cache, {s.prefilled_tokens} prefilled")
    sizes = cache_bytes(session.live.cache)
    _stage(6, f"cache: {len(session.live.tokens)} positions, {sizes['total']} bytes (global KV "
              f"{sizes['global_kv']}, window rings {sizes['window']}, other {sizes['other']})")
    print("next: mlx_v41.chat --model demo, or --model <the real checkpoint>")


def setup_arg_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="mlx_v41.demo", description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("-p", "--prompt", type=utf8_flag, default=DEFAULT_PROMPT,
        help=f"the first user message (default {DEFAULT_PROMPT!r})")
    add("-m", "--max-tokens", type=_number(int, 1, what="a positive integer"),
        default=DEFAULT_MAX_TOKENS, help=f"most tokens per reply (default {DEFAULT_MAX_TOKENS})")
    add("--folder", type=Path, default=None,
        help="where to build the demo checkpoint (default ~/.cache/mlx_v41)")
    add("--rebuild", action="store_true", help="rebuild the checkpoint")
    return parser


def run(args) -> int:
    run_demo(args.prompt, args.max_tokens, args.folder, args.rebuild)
    return 0


def main(argv=None) -> int:
    return run_command(run, setup_arg_parser().parse_args(argv))  # Ctrl-C, a bad --folder
