"""`mlx_v41.generate`: one reply to a prompt, in mlx-lm's conventions.

    mlx_v41.generate --model demo -p "Hello"
    mlx_v41.generate --model path/to/DeepSeek-V4.1-Flash -p "Why is the sky blue?" -m 512
    mlx_v41.generate --model path/to/DeepSeek-V4.1-Flash -p "Hello" --dspark
    mlx_v41.generate --model path/to/DeepSeek-V4.1-Flash --image cat.png -p "What is this?"

Prompts are rendered with the V4.1 chat format; generation stops on EOS and the end-of-turn
tokens. In thinking mode the reasoning is printed apart from the answer (`cli.reasoning`).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import List, Optional

import mlx.core as mx

from ..cache.layer import CacheError
from ..checkpoint.source import DEMO, load
from .args import (ArgumentParser, DEFAULT_MAX_TOKENS, DEFAULT_PROMPT, add_hide_thinking_argument,
                   add_model_arguments, decode_settings, load_options, report_experts,
                   utf8_flag, utf8_problem)
from .reasoning import ReplyPrinter
from ..generation.api import GenerationResponse, prefill, print_stats, stream_decode, wired_limit
from ..generation.prompt_reuse import (PromptCache, prompt_cache_exists, read_prompt_cache,
                                       reuse_prompt_cache, write_prompt_cache)
from ..generation.api import PrefillProgress
from ..distributed.cli import add_distributed_arguments, distributed_loader
from ..distributed.link import DistributedError, is_backend_error
from ..generation.group import ONE_PROCESS


def setup_arg_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="mlx_v41.generate",
                            description="Generate a reply with DeepSeek V4.1 Flash.")
    add_model_arguments(parser, DEFAULT_MAX_TOKENS, None)
    parser.add_argument("-p", "--prompt", type=utf8_flag, default=DEFAULT_PROMPT,
                        help="the user message ('-' reads it from stdin)")
    parser.add_argument("--ignore-chat-template", action="store_true",
                        help="use the prompt text as is (BOS added when missing; the reply is "
                             "printed as is, reasoning not set apart)")
    add_hide_thinking_argument(parser)
    parser.add_argument("--prompt-cache-file", default=None,
                        help="prompt cache file (mlx_v41 format, any name, e.g. a saved chat "
                             "session made with the same model, --prefill-mode, --dspark "
                             "and overrides): its cached prefix of this prompt is reused; "
                             "written with this prompt when the file does not exist (across "
                             "ranks: rank r's share in FILE.rank<r>-of-<n>, rank 0's in FILE)")
    add_distributed_arguments(parser)
    parser.add_argument("--image", action="extend", nargs="+", default=[], metavar="IMAGE",
                        help="an image (path, URL or data: URI); repeatable. They go before "
                             "the user's text, or with --ignore-chat-template fill the "
                             "prompt's <｜deepseek_image｜> placeholders in order")
    return parser


def prompt_tokens(args, tokenizer) -> List[int]:
    """The CLI prompt as token ids: the chat format unless --ignore-chat-template."""
    text = read_stdin() if args.prompt == "-" else \
        args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    if args.ignore_chat_template:
        return tokenizer.encode_prompt(text)
    messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    messages.append({"role": "user", "content": user_content(text, args.image)})
    return tokenizer.encode_chat(messages, args.thinking, args.reasoning_effort)


def read_stdin() -> str:
    """The prompt from stdin (-p -); a ValueError naming stdin unless it is valid UTF-8."""
    try:
        text = sys.stdin.read()
    except UnicodeDecodeError as e:  # a stdin decoding strictly
        raise ValueError(f"stdin (-p -): not valid {e.encoding} (byte 0x{e.object[e.start]:02x})"
                         ) from None
    problem = utf8_problem(text)  # a stdin decoding with surrogateescape
    if problem is not None:
        raise ValueError(f"stdin (-p -): {problem}")
    return text


def user_content(text: str, images) -> object:
    """A user message's content: the text, after the images' blocks when there are any
    (mlx-vlm's order)."""
    if not images:
        return text
    return [{"type": "image", "image": str(image)} for image in images] + \
        [{"type": "text", "text": text}]


def _cached_prefix(path: Path, model, tokens, images: list, group) -> PromptCache:
    cache, meta = read_prompt_cache(path, model, group)
    if "tokens" not in meta:
        raise CacheError(f"{path}: the prompt cache does not record its tokens")
    reused, _ = reuse_prompt_cache(model, tokens, [PromptCache.from_metadata(cache, meta)],
                                   images)
    print(f"prompt cache: reusing {len(reused.tokens)} of {len(tokens)} prompt tokens",
          file=sys.stderr)
    return reused


def run(args) -> int:
    if args.seed is not None:
        mx.random.seed(args.seed)
    if args.model == DEMO:
        print("demo model: a tiny random checkpoint, so the text is random", file=sys.stderr)
    loader = distributed_loader(args)
    model, tokenizer = (loader or load)(args.model, prefill_mode=args.prefill_mode,
                                        dspark=args.dspark, head_dtype=args.head_dtype,
                                        **load_options(args))
    report_experts(model)
    group = ONE_PROCESS if loader is None else model.group
    with wired_limit(model):
        response = _reply(args, model, tokenizer, group)
    print("=" * 10)
    if response is not None and model.expert_store is not None:
        response.expert_stats = model.expert_store.stats  # the run's: one per process
    print_stats(response)
    return 0


def _reply(args, model, tokenizer, group) -> Optional[GenerationResponse]:
    """Prefill (reusing a prompt-cache file), then stream the reply to stdout."""
    prompt = group.prepare_prompt(model, prompt_tokens(args, tokenizer), args.image)
    tokens, records = prompt.ids, prompt.records()
    path = Path(args.prompt_cache_file) if args.prompt_cache_file else None
    is_saved = path is not None and prompt_cache_exists(path, group)
    state = _cached_prefix(path, model, tokens, records, group) if is_saved else \
        PromptCache(model.make_cache())
    todo = tokens[len(state.tokens):]
    tic = time.perf_counter()
    logits = prefill(model, todo, state.cache, args.prefill_step_size,
                     PrefillProgress(args.prefill_step_size),
                     prompt.inputs(model, len(state.tokens)), group)
    seconds = time.perf_counter() - tic
    if path and not is_saved:
        write_prompt_cache(path, state.cache, model,
                           {**PromptCache(state.cache, tokens, records).metadata(),
                            "model": str(args.model)}, group)
    print("=" * 10, flush=True)
    response = None
    printer = ReplyPrinter(sys.stdout, args.thinking and not args.ignore_chat_template,
                           show=not args.hide_thinking)
    for response in stream_decode(model, tokenizer, logits, state.cache, prompt_tokens=len(todo),
                                  prompt_seconds=seconds, max_tokens=args.max_tokens,
                                  history=todo, group=group, **decode_settings(args)):
        printer.write(response.text)
    printer.finish()
    print()
    return response


def main(argv=None) -> int:
    args = setup_arg_parser().parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        print("\n[interrupted]", file=sys.stderr)
        return 130
    except (ValueError, OSError, DistributedError) as e:  # CheckpointError, ConfigError, ...
        print(f"error: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:  # a collective evaluated by the decode loop lost a rank
        if not is_backend_error(e):
            raise
        print(f"error: lost a rank during generation ({e})", file=sys.stderr)
        return 1
