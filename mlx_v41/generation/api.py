"""Generation in mlx-lm's conventions: `prefill`, `generate_step`, `stream_generate`,
`generate`. Every token a stream yields has been fed to the cache, so after a stream the cache
holds the prompt and all yielded tokens (the EOS included).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence, Union

import mlx.core as mx

from .group import ONE_PROCESS, ProcessGroup
from .speculative import DraftStats, check_draft_settings, speculative_steps


DEFAULT_PREFILL_STEP_SIZE = 2048


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
        from_draft: the token is a DSpark draft the target accepted (mlx-lm's field).
        draft_stats: with draft="dspark", the stream's drafts proposed / accepted so far.
        expert_stats: on the last response of a model whose experts are streamed, the
            stream's expert-cache counters (`ExpertStats`: hit rate, bytes read, waits).
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
    draft_stats: Optional[DraftStats] = None
    expert_stats: Optional[object] = None


def wired_limit(model):
    """mlx-lm's context manager that keeps the weights wired in memory on Metal (and warns
    when they near the recommended working set); it does nothing elsewhere."""
    from mlx_lm.generate import wired_limit as mlx_lm_wired_limit

    return mlx_lm_wired_limit(model)


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
            progress: Optional[Callable[[int, int], None]] = None, images=None,
            group: ProcessGroup = ONE_PROCESS) -> mx.array:
    """Run `tokens` into `cache` (chunks of `step_size`); the last position's logits [1, 1, V].
    `images`: the `vision.ImageInputs` of the tokens' image spans; `group`: the processes
    running the model (`generation.group`)."""
    check_context(model, cache[0].offset, len(tokens))
    with group.busy("prefilling a prompt"):
        logits = model.prefill(mx.array([list(tokens)], dtype=mx.int32), cache,
                               step_size=step_size, last_only=True, progress=progress,
                               images=images)
        mx.eval(logits)
    return logits


def generate_step(model, logits: mx.array, cache: list, *, tokens: Sequence[int] = (),
                  sampler=None, logits_processors=None, max_tokens: int = 256,
                  group: ProcessGroup = ONE_PROCESS) -> Iterator[tuple]:
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
        token = group.agree_on_token(sampler(logprobs))
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
                  history: Sequence[int] = (), draft: Optional[str] = None,
                  num_draft_tokens: int = 5, draft_confidence: Optional[float] = None,
                  group: ProcessGroup = ONE_PROCESS) -> Iterator[GenerationResponse]:
    """`GenerationResponse`s from the prompt's last `logits` (after `prefill`)."""
    # Every yielded token is fed, so the context caps the reply.
    max_tokens = min(max_tokens, model.args.text_config.max_position_embeddings - cache[0].offset)
    prompt_tps = prompt_tokens / max(prompt_seconds, 1e-9)
    detokenizer = tokenizer.detokenizer
    stops = tokenizer.eos_token_ids
    tic, token, n = time.perf_counter(), None, 0
    stats = DraftStats() if draft else None
    steps = _steps(model, logits, cache, history, sampler, logits_processors, max_tokens, stops,
                   draft, num_draft_tokens, draft_confidence, stats, group)
    from_draft = False
    with group.busy("generating a reply"):
        for n, (token, logprobs, from_draft) in enumerate(steps, start=1):
            if token in stops:
                break
            detokenizer.add_token(token)
            if n == max_tokens:
                break
            yield GenerationResponse(detokenizer.last_segment, token, logprobs, prompt_tokens,
                                     prompt_tps, n, n / (time.perf_counter() - tic),
                                     mx.get_peak_memory() / 1e9, from_draft=from_draft,
                                     draft_stats=stats)
    if token is None:
        return
    detokenizer.finalize()
    yield GenerationResponse(detokenizer.last_segment, token, logprobs, prompt_tokens,
                             prompt_tps, n, n / (time.perf_counter() - tic),
                             mx.get_peak_memory() / 1e9,
                             "stop" if token in stops else "length", from_draft, stats)


def _steps(model, logits, cache, history, sampler, logits_processors, max_tokens, stops, draft,
           num_draft_tokens, draft_confidence, stats, group) -> Iterator[tuple]:
    """(token, logprobs, from_draft) of plain or DSpark speculative decoding."""
    if draft is None:
        steps = generate_step(model, logits, cache, tokens=history, sampler=sampler,
                              logits_processors=logits_processors, max_tokens=max_tokens,
                              group=group)
        return ((token, logprobs, False) for token, logprobs in steps)
    if draft != "dspark":
        raise ValueError(f"draft must be None or 'dspark', got {draft!r}")
    sampling = check_draft_settings(model, sampler, num_draft_tokens)
    return speculative_steps(model, logits, cache, sampling=sampling, max_tokens=max_tokens,
                             stops=stops, num_draft_tokens=num_draft_tokens,
                             draft_confidence=draft_confidence, stats=stats,
                             logits_processors=logits_processors, history=history,
                             group=group)


def stream_generate(model, tokenizer, prompt: Union[str, Sequence[int], mx.array],
                    max_tokens: int = 256, *, sampler=None, logits_processors=None,
                    prompt_cache: Optional[list] = None,
                    prefill_step_size: Optional[int] = DEFAULT_PREFILL_STEP_SIZE,
                    prompt_progress_callback=None, draft: Optional[str] = None,
                    num_draft_tokens: int = 5,
                    draft_confidence: Optional[float] = None,
                    images: Optional[Sequence] = None,
                    group: ProcessGroup = ONE_PROCESS) -> Iterator[GenerationResponse]:
    """Stream a reply to `prompt`.

    Args:
        prompt: text (tokenized as is, special tokens matched, BOS added when the cache is empty
            and the text lacks it; render chats with `tokenizer.apply_chat_template(messages,
            tokenize=False)`), or token ids. Each `<｜deepseek_image｜>` placeholder (one
            token) is filled by the next of `images` and expanded into its span.
        max_tokens: most tokens to generate (also capped by the context).
        sampler: mlx-lm sampler over log-probabilities (`mlx_lm.sample_utils.make_sampler`);
            default greedy.
        logits_processors: mlx-lm logits processors (`make_logits_processors`).
        prompt_cache: `model.make_cache()` list continued in place: the prompt is appended to
            what it holds.
        prefill_step_size: prompt tokens per prefill chunk.
        prompt_progress_callback: called as (tokens done, total) during the prefill.
        draft: "dspark" decodes speculatively with the checkpoint's drafter (load with
            dspark=True): greedy output is plain greedy decoding's; sampling needs
            `sampler=mlx_v41.Sampling(...)` and is distributed exactly as plain sampling.
        num_draft_tokens: drafts verified per cycle, 1..5.
        draft_confidence: verify only the longest prefix whose running product of the
            drafter's sigmoid(confidence) stays >= this (None: always `num_draft_tokens`).
        images: one per placeholder, in order: paths, bytes, base64 `data:` URIs, http(s)
            URLs, PIL images or chat image blocks (`collect_images(messages)`). Needs the
            vision tower (loaded by default when the checkpoint has it).
        group: the processes running the model (`generation.group`): one process by default;
            a group model's ranks pass `model.group` (`mlx_v41.distributed`).
    Yields:
        `GenerationResponse`s; the last one has `finish_reason` "stop" or "length".
    """
    cache = model.make_cache() if prompt_cache is None else prompt_cache
    if isinstance(prompt, str):
        ids = tokenizer.encode_prompt(prompt, add_bos=cache[0].offset == 0)
    else:
        ids = _one_sequence(prompt)
    with wired_limit(model):
        tic = time.perf_counter()
        expanded = group.prepare_prompt(model, ids, images)
        ids = expanded.ids
        store = getattr(model, "expert_store", None)
        before = None if store is None else store.stats.snapshot()
        logits = prefill(model, ids, cache, prefill_step_size, prompt_progress_callback,
                         expanded.inputs(model), group)
        for response in stream_decode(model, tokenizer, logits, cache, prompt_tokens=len(ids),
                                      prompt_seconds=time.perf_counter() - tic,
                                      max_tokens=max_tokens, sampler=sampler,
                                      logits_processors=logits_processors, history=ids,
                                      draft=draft, num_draft_tokens=num_draft_tokens,
                                      draft_confidence=draft_confidence, group=group):
            if response.finish_reason is not None and store is not None:
                response.expert_stats = store.stats.since(before)
            yield response


def _one_sequence(prompt) -> list:
    """Token ids of one sequence: a list, a [S] array or a [1, S] array."""
    if not isinstance(prompt, mx.array):
        return list(prompt)
    if prompt.ndim == 2 and prompt.shape[0] == 1:
        prompt = prompt[0]
    if prompt.ndim != 1:
        raise ValueError(f"stream_generate runs one sequence: prompt has shape "
                         f"{list(prompt.shape)} (a batch runs through model(ids, cache=...); "
                         "DSpark drafts one sequence per cache)")
    return prompt.tolist()


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
    stats = response.draft_stats
    if stats is not None:
        print(f"Drafts: {stats.accepted} accepted of {stats.proposed} proposed, "
              f"{stats.tokens_per_cycle:.2f} tokens per verify cycle", file=file)
    if response.expert_stats is not None:
        print(f"Experts: {response.expert_stats.summary()}", file=file)
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
