"""Generation in mlx-lm's conventions: `load`, `stream_generate`, `generate`, and the
`mlx_v41.generate` command.

    mlx_v41.generate --model demo -p "Hello"
    mlx_v41.generate --model path/to/DeepSeek-V4.1-Flash -p "Why is the sky blue?" -m 512

Prompts are rendered with the V4.1 chat format (`chat_format.py`); generation stops on EOS and
the end-of-turn tokens. Every token a stream yields has been fed to the cache, so after a stream
the cache holds the prompt and all yielded tokens (the EOS included).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Sequence, Union

import mlx.core as mx

from .cache import CacheError, trim_cache
from .model import PREFILL_MODES
from .prompt_cache import copy_cache, load_prompt_cache, save_prompt_cache
from .model_source import DEMO, load

DEFAULT_PROMPT = "hello"
DEFAULT_MAX_TOKENS = 100
DEFAULT_TEMP = 0.0
DEFAULT_TOP_P = 1.0
DEFAULT_MIN_P = 0.0
DEFAULT_TOP_K = 0
DEFAULT_PREFILL_STEP_SIZE = 2048
PREFILL_MODE_HELP = ("ced (default): exact encoder-only prefill plus the decoder halo; full: "
                     "every layer over every prompt row, like the reference; ced_replay: the "
                     "tech report's bounded replay, APPROXIMATE (its logits differ from "
                     "ced/full)")


class PromptTooLongError(ValueError):
    """The prompt does not fit the model's context (text_config.max_position_embeddings)."""


@dataclass
class GenerationResponse:
    """One step of `stream_generate` (mlx-lm's fields).

    Args:
        text: the next segment of decoded text (may be empty: an unfinished UTF-8 character or
            a stop token prints nothing).
        token: the token id.
        logprobs: log-probabilities over the vocabulary [V].
        prompt_tokens / prompt_tps: tokens prefilled for this call and their rate.
        generation_tokens / generation_tps: tokens generated so far and their rate.
        peak_memory: peak MLX memory so far, GB.
        finish_reason: "stop" (EOS / end of turn), "length" (max_tokens or the context), None.
    """

    text: str
    token: int
    logprobs: mx.array
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: Optional[str] = None
    from_draft: bool = False


# ---------------------------------------------------------------- prompt caches

def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class PromptCache:
    """A model cache and the token ids it holds (prompt and fed tokens, in order)."""

    cache: list
    tokens: List[int] = field(default_factory=list)

    def copy(self) -> "PromptCache":
        return PromptCache(copy_cache(self.cache), list(self.tokens))

    def rewind_for(self, prompt: Sequence[int]) -> Optional[int]:
        """Trim to the longest prefix shared with `prompt` that leaves at least one prompt
        token to run (its logits start the reply). Returns the tokens kept, or None (the cache
        unchanged) when the rollback is more than the cache can undo exactly."""
        keep = min(_common_prefix(self.tokens, prompt), len(prompt) - 1)
        try:
            trim_cache(self.cache, len(self.tokens) - keep)
        except CacheError:
            return None
        del self.tokens[keep:]
        return keep


def reuse_prompt_cache(model, prompt: Sequence[int], candidates) -> tuple:
    """(cache, index): a rewound copy of the candidate that keeps the longest prefix of
    `prompt` and its index, or a new empty cache and None. Candidates are left untouched;
    None entries are skipped."""
    best, index = PromptCache(model.make_cache()), None
    for i, candidate in enumerate(candidates):
        if candidate is None:
            continue
        trial = candidate.copy()
        kept = trial.rewind_for(prompt)
        if kept is not None and (index is None or kept > len(best.tokens)):
            best, index = trial, i
    return best, index


def wired_limit(model):
    """mlx-lm's context manager that keeps the weights wired in memory on Metal (and warns
    when they near the recommended working set); it does nothing elsewhere."""
    from mlx_lm.generate import wired_limit as mlx_lm_wired_limit

    return mlx_lm_wired_limit(model)


def write_prompt_cache(path, cache: list, model, metadata: dict) -> None:
    """`save_prompt_cache` with file-system problems reported as OSError naming the file."""
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"{path.parent}: no such folder")
    try:
        save_prompt_cache(path, cache, model, metadata)
    except RuntimeError as e:  # MLX reports write failures as RuntimeError
        raise OSError(f"{path}: cannot write the prompt cache ({e})") from None


# ---------------------------------------------------------------- generation

def check_context(model, start: int, length: int) -> int:
    """Room left for generated tokens after a prompt of `length` at position `start`."""
    limit = model.args.text_config.max_position_embeddings
    if start + length >= limit:
        cached = f" after {start} cached" if start else ""
        raise PromptTooLongError(
            f"the prompt has {length} tokens{cached}, but the model's context is {limit} tokens "
            "(text_config.max_position_embeddings), leaving no room to generate")
    return limit - start - length


def prefill(model, tokens: Sequence[int], cache: list, step_size: Optional[int] = None,
            progress: Optional[Callable[[int, int], None]] = None) -> mx.array:
    """Run `tokens` into `cache` (chunks of `step_size`); the last position's logits [1, 1, V]."""
    check_context(model, cache[0].offset, len(tokens))
    logits = model.prefill(mx.array([list(tokens)], dtype=mx.int32), cache, step_size=step_size,
                           last_only=True, progress=progress)
    mx.eval(logits)
    return logits


def generate_step(model, logits: mx.array, cache: list, *, tokens: Sequence[int] = (),
                  sampler=None, logits_processors=None,
                  max_tokens: int = 256) -> Iterator[tuple]:
    """(token, logprobs) pairs continuing from the prompt's last `logits`. Each token is fed to
    the cache before it is yielded, so the next step computes while the caller handles it."""
    from mlx_lm.sample_utils import greedy_sampler

    sampler = sampler or greedy_sampler
    history = mx.array(list(tokens), dtype=mx.int32)

    def sample(step_logits):
        nonlocal history
        step_logits = step_logits[:, -1, :]
        for processor in logits_processors or ():
            step_logits = processor(history, step_logits)
        logprobs = step_logits - mx.logsumexp(step_logits, axis=-1, keepdims=True)
        token = sampler(logprobs)
        if logits_processors:
            history = mx.concatenate([history, token.astype(mx.int32)])
        return token, logprobs[0]

    token, logprobs = sample(logits)
    mx.async_eval(token, logprobs)
    for _ in range(max_tokens):
        following = sample(model(token[:, None], cache=cache))
        # The cache too: state nothing reads until a trim (the compressors' input rings)
        # would otherwise keep a graph that grows by a node per token.
        mx.async_eval(*following, [c.state for c in cache])
        yield token.item(), logprobs
        token, logprobs = following


def stream_decode(model, tokenizer, logits, cache, *, prompt_tokens: int, prompt_seconds: float,
                  max_tokens: int, sampler=None, logits_processors=None,
                  history: Sequence[int] = ()) -> Iterator[GenerationResponse]:
    """`GenerationResponse`s from the prompt's last `logits` (after `prefill`)."""
    # Every yielded token is fed, so the context caps the reply.
    max_tokens = min(max_tokens, model.args.text_config.max_position_embeddings - cache[0].offset)
    prompt_tps = prompt_tokens / max(prompt_seconds, 1e-9)
    detokenizer = tokenizer.detokenizer
    stops = tokenizer.eos_token_ids
    tic, token, n = time.perf_counter(), None, 0
    steps = generate_step(model, logits, cache, tokens=history, sampler=sampler,
                          logits_processors=logits_processors, max_tokens=max_tokens)
    for n, (token, logprobs) in enumerate(steps, start=1):
        if token in stops:
            break
        detokenizer.add_token(token)
        if n == max_tokens:
            break
        yield GenerationResponse(detokenizer.last_segment, token, logprobs, prompt_tokens,
                                 prompt_tps, n, n / (time.perf_counter() - tic),
                                 mx.get_peak_memory() / 1e9)
    if token is None:
        return
    detokenizer.finalize()
    yield GenerationResponse(detokenizer.last_segment, token, logprobs, prompt_tokens,
                             prompt_tps, n, n / (time.perf_counter() - tic),
                             mx.get_peak_memory() / 1e9,
                             "stop" if token in stops else "length")


def stream_generate(model, tokenizer, prompt: Union[str, Sequence[int], mx.array],
                    max_tokens: int = 256, *, sampler=None, logits_processors=None,
                    prompt_cache: Optional[list] = None,
                    prefill_step_size: Optional[int] = DEFAULT_PREFILL_STEP_SIZE,
                    prompt_progress_callback=None) -> Iterator[GenerationResponse]:
    """Stream a reply to `prompt`.

    Args:
        prompt: text (tokenized as is, special tokens matched, BOS added when the cache is empty
            and the text lacks it; render chats with `tokenizer.apply_chat_template(messages,
            tokenize=False)`), or token ids.
        max_tokens: most tokens to generate (also capped by the context).
        sampler: mlx-lm sampler over log-probabilities (`mlx_lm.sample_utils.make_sampler`);
            default greedy.
        logits_processors: mlx-lm logits processors (`make_logits_processors`).
        prompt_cache: `model.make_cache()` list continued in place: the prompt is appended to
            what it holds.
        prefill_step_size: prompt tokens per prefill chunk.
        prompt_progress_callback: called as (tokens done, total) during the prefill.
    Yields:
        `GenerationResponse`s; the last one has `finish_reason` "stop" or "length".
    """
    cache = model.make_cache() if prompt_cache is None else prompt_cache
    if isinstance(prompt, str):
        ids = tokenizer.encode_prompt(prompt, add_bos=cache[0].offset == 0)
    else:
        ids = prompt.tolist() if isinstance(prompt, mx.array) else list(prompt)
    with wired_limit(model):
        tic = time.perf_counter()
        logits = prefill(model, ids, cache, prefill_step_size, prompt_progress_callback)
        yield from stream_decode(model, tokenizer, logits, cache, prompt_tokens=len(ids),
                                 prompt_seconds=time.perf_counter() - tic,
                                 max_tokens=max_tokens, sampler=sampler,
                                 logits_processors=logits_processors, history=ids)


def generate(model, tokenizer, prompt, verbose: bool = False, **kwargs) -> str:
    """The whole reply as text; `verbose` prints the stream and mlx-lm's stats lines. Other
    keywords go to `stream_generate`."""
    text, response = "", None
    if verbose:
        print("=" * 10)
    for response in stream_generate(model, tokenizer, prompt, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose:
        print()
        print("=" * 10)
        print_stats(response)
    return text


def print_stats(response: Optional[GenerationResponse], file=None) -> None:
    """mlx-lm's end-of-generation lines."""
    file = file or sys.stdout
    if response is None or response.generation_tokens == 0:
        print("No text generated for this prompt", file=file)
        return
    print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec",
          file=file)
    print(f"Generation: {response.generation_tokens} tokens, "
          f"{response.generation_tps:.3f} tokens-per-sec", file=file)
    print(f"Peak memory: {response.peak_memory:.3f} GB", file=file)


class PrefillProgress:
    """Prints `prefill done/total tokens, N tokens/s` on one stderr line while a long prompt
    runs (only when it takes more than one chunk)."""

    def __init__(self, step_size: Optional[int], file=None):
        self.step_size, self.file = step_size, file or sys.stderr
        self.tic = time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        if self.step_size is None or total <= self.step_size:
            return
        rate = done / max(time.perf_counter() - self.tic, 1e-9)
        end = "\n" if done >= total else ""
        print(f"\rprefill {done}/{total} tokens, {rate:.1f} tokens/s", end=end, file=self.file,
              flush=True)


# ---------------------------------------------------------------- command line

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
        if (low is not None and value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value
    return parse


def _effort(text):
    from .chat_format import resolve_reasoning_effort

    value = int(text) if text.strip().lstrip("-").isdigit() else text
    try:
        resolve_reasoning_effort(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def add_model_arguments(parser, default_max_tokens: int, default_seed) -> None:
    """The flags `mlx_v41.generate` and `mlx_v41.chat` share (mlx-lm's names)."""
    add = parser.add_argument
    add("--model", required=True,
        help="model folder (published layout), Hugging Face repo id, or 'demo' (a tiny random "
             "checkpoint built on first use; its text is random)")
    add("--system-prompt", default=None, help="system message for the chat format")
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
    add("--seed", type=int, default=default_seed, help="PRNG seed")
    add("--prefill-step-size", type=_number(int, 1, what="a positive integer"),
        default=DEFAULT_PREFILL_STEP_SIZE,
        help=f"prompt tokens per prefill chunk (default {DEFAULT_PREFILL_STEP_SIZE})")
    add("--prefill-mode", choices=PREFILL_MODES, default="ced", help=PREFILL_MODE_HELP)
    add("--thinking", action=argparse.BooleanOptionalAction, default=True,
        help="thinking mode (the reply reasons before answering; default) or chat mode")
    add("--reasoning-effort", type=_effort, default=None,
        help="thinking mode only: low (50), high (75, default), max (100) or an integer 1-100")


def make_sampler_from(args):
    from mlx_lm.sample_utils import make_sampler

    return make_sampler(args.temp, args.top_p, args.min_p, top_k=args.top_k)


def setup_arg_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="mlx_v41.generate",
                            description="Generate a reply with DeepSeek V4.1 Flash.")
    add_model_arguments(parser, DEFAULT_MAX_TOKENS, None)
    parser.add_argument("-p", "--prompt", default=DEFAULT_PROMPT,
                        help="the user message ('-' reads it from stdin)")
    parser.add_argument("--ignore-chat-template", action="store_true",
                        help="use the prompt text as is (BOS added when missing)")
    parser.add_argument("--prompt-cache-file", default=None,
                        help="prompt cache file (mlx_v41 format, e.g. a saved chat session): "
                             "its cached prefix of this prompt is reused; written with this "
                             "prompt when the file does not exist")
    return parser


def prompt_tokens(args, tokenizer) -> List[int]:
    """The CLI prompt as token ids: the chat format unless --ignore-chat-template."""
    text = sys.stdin.read() if args.prompt == "-" else \
        args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    if args.ignore_chat_template:
        return tokenizer.encode_prompt(text)
    messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    messages.append({"role": "user", "content": text})
    return tokenizer.encode_chat(messages, args.thinking, args.reasoning_effort)


def _cached_prefix(path: Path, model, tokens) -> PromptCache:
    cache, meta = load_prompt_cache(path, model, return_metadata=True)
    if "tokens" not in meta:
        raise CacheError(f"{path}: the prompt cache does not record its tokens")
    reused, _ = reuse_prompt_cache(model, tokens, [PromptCache(cache, json.loads(meta["tokens"]))])
    print(f"prompt cache: reusing {len(reused.tokens)} of {len(tokens)} prompt tokens",
          file=sys.stderr)
    return reused


def run(args) -> int:
    if args.seed is not None:
        mx.random.seed(args.seed)
    if args.model == DEMO:
        print("demo model: a tiny random checkpoint, so the text is random", file=sys.stderr)
    model, tokenizer = load(args.model, prefill_mode=args.prefill_mode)
    with wired_limit(model):
        response = _reply(args, model, tokenizer)
    print("=" * 10)
    print_stats(response)
    return 0


def _reply(args, model, tokenizer) -> Optional[GenerationResponse]:
    """Prefill (reusing a prompt-cache file), then stream the reply to stdout."""
    tokens = prompt_tokens(args, tokenizer)
    path = Path(args.prompt_cache_file) if args.prompt_cache_file else None
    state = _cached_prefix(path, model, tokens) if path and path.exists() else \
        PromptCache(model.make_cache())
    todo = tokens[len(state.tokens):]
    tic = time.perf_counter()
    logits = prefill(model, todo, state.cache, args.prefill_step_size,
                     PrefillProgress(args.prefill_step_size))
    seconds = time.perf_counter() - tic
    if path and not path.exists():
        write_prompt_cache(path, state.cache, model, {"tokens": json.dumps(tokens),
                                                      "model": str(args.model)})
    print("=" * 10, flush=True)
    response = None
    for response in stream_decode(model, tokenizer, logits, state.cache, prompt_tokens=len(todo),
                                  prompt_seconds=seconds, max_tokens=args.max_tokens,
                                  sampler=make_sampler_from(args), history=todo):
        print(response.text, end="", flush=True)
    print()
    return response


def main(argv=None) -> int:
    args = setup_arg_parser().parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        print("\n[interrupted]", file=sys.stderr)
        return 130
    except (ValueError, OSError) as e:  # CheckpointError, ConfigError, CacheError, bad prompt
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
