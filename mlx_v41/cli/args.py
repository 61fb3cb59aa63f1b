"""The flags `mlx_v41.generate`, `mlx_v41.chat` and `mlx_v41.server` share (mlx-lm's names; the
load-time overrides also in `mlx_v41.perplexity`), one-line argument errors.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Optional


from ..checkpoint.streaming import AUTO, RESIDENT, parse_memory_size
from ..model.layers import HEAD_DTYPES
from ..model.model import PREFILL_MODES
from ..generation.api import DEFAULT_PREFILL_STEP_SIZE
from ..generation.sequence import MAX_SEED
from ..generation.speculative import MAX_DRAFT_TOKENS, Sampling


DEFAULT_PROMPT = "hello"


DEFAULT_MAX_TOKENS = 100


DEFAULT_TEMP = 0.0


DEFAULT_TOP_P = 1.0


DEFAULT_MIN_P = 0.0


DEFAULT_TOP_K = 0




PREFILL_MODE_HELP = ("ced (default): exact encoder-only prefill plus the decoder halo; full: "
                     "every layer over every prompt row, like the reference; ced_replay: the "
                     "tech report's bounded replay, APPROXIMATE (its logits differ from "
                     "ced/full)")


HEAD_DTYPE_HELP = ("LM head weights: float32 (default, the reference's head) or bfloat16 (half "
                   "the bytes per token; logits rounded to bf16)")


class ArgumentParser(argparse.ArgumentParser):
    """Reports a bad flag or value on one line."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _number(kind, low=None, high=None, what=""):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if (kind is float and not math.isfinite(value)) or (low is not None and value < low) \
                or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value
    return parse


def utf8_problem(text: str) -> Optional[str]:
    """None when `text` is valid UTF-8, else what is wrong with it. Bytes that are not UTF-8
    reach Python (argv, stdin) as lone surrogates U+DC80..U+DCFF."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        bad = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else \
            f"lone surrogate U+{code:04X}"
        return f"not valid UTF-8 ({bad} at character {e.start})"
    return None


def utf8_flag(text: str) -> str:
    """A text flag's value, refused (an argparse error naming the flag) unless valid UTF-8."""
    problem = utf8_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def _confidence(text):
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a probability in (0, 1]")
    return value


def _effort(text):
    from ..chat.format import resolve_reasoning_effort

    value = int(text) if text.strip().lstrip("-").isdigit() else text
    try:
        resolve_reasoning_effort(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


# Flag -> the `load_model(overrides=...)` key it sets (docs/quality.md).
OVERRIDE_FLAGS = {"index_topk": "index_topk", "candidate_blocks": "candidate_topk_blocks",
                  "sliding_window": "sliding_window"}


def add_override_arguments(parser) -> None:
    """The load-time overrides of the sparse attention (every command that loads a model)."""
    add, positive = parser.add_argument, _number(int, 1, what="a positive integer")
    add("--index-topk", type=positive, default=None,
        help="compressed rows each query attends (default: the checkpoint's index_topk, 512)")
    add("--candidate-blocks", type=positive, default=None,
        help="blocks in the candidate pool of the Reindex layers (default: the checkpoint's "
             "candidate_topk_blocks, 2048)")
    add("--sliding-window", type=positive, default=None,
        help="window positions each query attends, at most the checkpoint's (128): an "
             "approximation below it")


def model_overrides(args) -> Optional[dict]:
    """The `overrides` of `load`/`load_model` the flags ask for (None: the checkpoint's)."""
    return {key: getattr(args, flag) for flag, key in OVERRIDE_FLAGS.items()
            if getattr(args, flag, None) is not None} or None


def expert_memory_value(text: str):
    """argparse type of `--expert-memory`."""
    if text in (AUTO, RESIDENT):
        return text
    try:
        return parse_memory_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a memory size (e.g. 48GB, 512MB, "
                                         "a number of bytes), 'auto' or 'resident'") from None


EXPERT_MEMORY_HELP = ("routed experts held in memory: auto (default: resident when the weights "
                      "fit this machine's working set, else streamed from the model folder), "
                      "resident, or a budget such as 48GB or 512MB (the rest read from SSD "
                      "when routed; the output is the same) (docs/memory.md)")


def add_expert_arguments(parser) -> None:
    """`--expert-memory`: the routed experts held in memory, the rest streamed (every command
    that loads a model)."""
    parser.add_argument("--expert-memory", type=expert_memory_value, default="auto",
                        metavar="SIZE", help=EXPERT_MEMORY_HELP)
    parser.add_argument("--expert-prefetch", type=_number(int, 0, 256, what="an integer in "
                                                          "0..256"),
                        default=0, metavar="N",
                        help="with streamed experts: read up to N experts the next layer is "
                             "predicted to route to while one computes (default 0: off; 16 to "
                             "try; docs/memory.md)")


def load_options(args) -> dict:
    """The `load` keywords of the override and expert flags."""
    return {"overrides": model_overrides(args),
            "expert_memory": getattr(args, "expert_memory", "auto"),
            "expert_prefetch": getattr(args, "expert_prefetch", 0)}


def report_experts(model, file=None) -> None:
    """The one line saying whether the experts are resident or streamed, and why."""
    plan = getattr(model, "expert_plan", None)
    group = getattr(model, "group", None)
    if plan is not None and (group is None or group.link.rank == 0):
        print(plan.line(), file=file or sys.stderr)


def expert_stats_line(model) -> Optional[str]:
    """mlx-lm style stats line of a streamed model's expert cache (None when resident)."""
    store = getattr(model, "expert_store", None)
    return None if store is None else f"Experts: {store.stats.summary()}"


def add_model_arguments(parser, default_max_tokens: int, default_seed) -> None:
    """The flags `mlx_v41.generate` and `mlx_v41.chat` share (mlx-lm's names)."""
    add = parser.add_argument
    add("--model", required=True,
        help="model folder (published layout), Hugging Face repo id, or 'demo' (a tiny random "
             "checkpoint built on first use; its text is random)")
    add("--system-prompt", type=utf8_flag, default=None,
        help="system message for the chat format")
    add("-m", "--max-tokens", type=_number(int, 1, what="a positive integer"),
        default=default_max_tokens, help=f"most tokens to generate (default {default_max_tokens})")
    add("--temp", type=_number(float, 0.0, what="a temperature >= 0"), default=DEFAULT_TEMP,
        help="sampling temperature; 0 is greedy (default 0; the model card evaluates at 1.0)")
    add("--top-p", type=_number(float, 0.0, 1.0, what="a probability in [0, 1]"),
        default=DEFAULT_TOP_P, help="nucleus sampling (default 1.0: off; model card: 0.95)")
    add("--min-p", type=_number(float, 0.0, 1.0, what="a probability in [0, 1]"),
        default=DEFAULT_MIN_P, help="min-p sampling (default 0: off)")
    add("--top-k", type=_number(int, 0, what="an integer >= 0"), default=DEFAULT_TOP_K,
        help="top-k sampling (default 0: off)")
    add("--seed", type=_number(int, 0, MAX_SEED, what=f"a seed in 0..{MAX_SEED}"),
        default=default_seed, help="PRNG seed")
    add("--prefill-step-size", type=_number(int, 1, what="a positive integer"),
        default=DEFAULT_PREFILL_STEP_SIZE,
        help=f"prompt tokens per prefill chunk (default {DEFAULT_PREFILL_STEP_SIZE})")
    add("--prefill-mode", choices=PREFILL_MODES, default="ced", help=PREFILL_MODE_HELP)
    add("--head-dtype", choices=HEAD_DTYPES, default="float32", help=HEAD_DTYPE_HELP)
    add_override_arguments(parser)
    add_expert_arguments(parser)
    add("--thinking", action=argparse.BooleanOptionalAction, default=True,
        help="thinking mode (the reply reasons before answering; default) or chat mode")
    add("--reasoning-effort", type=_effort, default=None,
        help="thinking mode only: low (50), high (75, default), max (100) or an integer 1-100")
    add("--dspark", action="store_true",
        help="load the checkpoint's DSpark drafter (mtp.* tensors) and decode speculatively "
             "(same output as plain decoding: greedy exactly, sampling in distribution)")
    add("--num-draft-tokens", type=_number(int, 1, MAX_DRAFT_TOKENS,
                                           what=f"an integer in 1..{MAX_DRAFT_TOKENS}"),
        default=MAX_DRAFT_TOKENS,
        help=f"with --dspark: drafts verified per cycle (default {MAX_DRAFT_TOKENS})")
    add("--draft-confidence", type=_confidence, default=None,
        help="with --dspark: verify only the drafts whose running product of the drafter's "
             "confidence stays >= this, in (0, 1] (default: all --num-draft-tokens)")


def add_hide_thinking_argument(parser) -> None:
    """`--hide-thinking` (`mlx_v41.generate`, `mlx_v41.chat`): the reply's reasoning not printed."""
    parser.add_argument("--hide-thinking", action="store_true",
                        help="thinking mode: print the answer only (the reasoning is shown by "
                             "default: dimmed on a terminal; elsewhere after a line [thinking], "
                             "the answer after a line [answer])")


def make_sampler_from(args):
    from mlx_lm.sample_utils import make_sampler

    return make_sampler(args.temp, args.top_p, args.min_p, top_k=args.top_k)


def decode_settings(args) -> dict:
    """The sampler and draft keywords of `stream_decode` (and `ChatSession`) for the flags.
    Speculative sampling is exact only with known settings, hence `Sampling` with --dspark."""
    if not args.dspark:
        return {"sampler": make_sampler_from(args)}
    return {"sampler": Sampling(args.temp, args.top_p, args.min_p, args.top_k),
            "draft": "dspark", "num_draft_tokens": args.num_draft_tokens,
            "draft_confidence": args.draft_confidence}


def run_command(run, args) -> int:
    """`run(args)` as a command runs it: Ctrl-C is exit status 130 and a ValueError or
    OSError (a bad file, checkpoint, config or flag value) one line on stderr and status 1."""
    try:
        return run(args)
    except KeyboardInterrupt:
        print("\n[interrupted]", file=sys.stderr)
        return 130
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
