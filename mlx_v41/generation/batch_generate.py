"""`batch_generate`: replies to a list of prompts, decoded together by a `BatchGenerator`
(mlx-lm's function of that name and its `BatchResponse`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

from ..cache.persistence import copy_cache
from .batch import BatchGenerator
from .sequence import BatchStats


@dataclass
class BatchResponse:
    """`batch_generate`'s result (mlx-lm's): texts in prompt order, stats, and with
    `return_prompt_caches` each sequence's cache (its prompt and reply)."""

    texts: List[str]
    stats: BatchStats
    caches: Optional[List[list]] = None
    token_ids: Optional[List[List[int]]] = None
    logprobs: Optional[List[List[float]]] = None



def batch_generate(model, tokenizer, prompts: Sequence[Union[Sequence[int], str]],
                   prompt_caches: Optional[List[list]] = None,
                   max_tokens: Union[int, List[int]] = 128, verbose: bool = False,
                   return_prompt_caches: bool = False, return_token_ids: bool = False,
                   return_logprobs: bool = False, **kwargs) -> BatchResponse:
    """Replies to every prompt, decoded together (mlx-lm's `batch_generate`).

    Args:
        prompts: token id lists (or strings, tokenized as `stream_generate` does).
        prompt_caches: a cache per prompt holding its prefix; they are not changed (each
            sequence continues a copy).
        max_tokens: one for all, or one per prompt.
        return_prompt_caches / return_token_ids / return_logprobs: add each sequence's final
            cache, generated ids (the stop token not included) and their log-probabilities.
        kwargs: `BatchGenerator` settings (`sampler`, `logits_processors`,
            `completion_batch_size`, `prefill_batch_size`, `prefill_step_size`,
            `prefill_budget`, `decode_prefill_budget` (default None here: whole chunks,
            as nothing streams), `min_prefill_chunk`, `draft`,
            `num_draft_tokens`, `draft_confidence`); `seeds`
            (one per prompt, as `insert`'s) and `images` (per
            prompt: None or the images of its placeholders, as `stream_generate`'s).
    Returns:
        `BatchResponse`. Each sequence's text equals what `generate` gives it alone (greedy,
        or sampled with the same seed).
    """
    from ..model.vision.prompt import prepare_prompt

    # every prompt is known at once and no reply streams to anyone: read prompts in whole
    # chunks (the pacing that keeps replies flowing would only slow the batch down)
    kwargs.setdefault("decode_prefill_budget", None)
    seeds = kwargs.pop("seeds", None)
    images = kwargs.pop("images", None) or [None] * len(prompts)
    generator = BatchGenerator(model, stop_tokens=tokenizer.eos_token_ids, **kwargs)
    caches = None if prompt_caches is None else [copy_cache(c) for c in prompt_caches]
    ids, inputs = [], []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            empty = caches is None or caches[i][0].offset == 0
            prompt = tokenizer.encode_prompt(prompt, add_bos=empty)
        expanded = prepare_prompt(model, list(prompt), images[i])  # image spans expanded
        ids.append(expanded.ids)
        inputs.append(expanded.inputs(model))
    uids = generator.insert(ids, max_tokens, caches, seeds=seeds, images=inputs)
    tokens = {uid: [] for uid in uids}
    logprobs = {uid: [] for uid in uids}
    finished = {}
    with generator.stats() as stats:
        while len(generator):
            for r in generator.next():
                if r.finish_reason == "error":
                    raise r.error
                if r.finish_reason != "stop" and r.token >= 0:
                    tokens[r.uid].append(r.token)
                    if return_logprobs:
                        logprobs[r.uid].append(r.logprobs[r.token].item())
                if r.finish_reason is not None:
                    finished[r.uid] = r.prompt_cache
                    if verbose:
                        print(f"[batch_generate] Finished processing {len(finished)}/"
                              f"{len(uids)} ...", end="\r")
    texts = [tokenizer.decode(tokens[uid]) for uid in uids]
    if verbose:
        print(f"\n[batch_generate] Prompt: {stats.prompt_tokens} tokens, "
              f"{stats.prompt_tps:.3f} tokens-per-sec")
        print(f"[batch_generate] Generation: {stats.generation_tokens} tokens, "
              f"{stats.generation_tps:.3f} tokens-per-sec")
        print(f"[batch_generate] Peak memory: {stats.peak_memory:.3f} GB")
    return BatchResponse(
        texts, stats, [finished[uid] for uid in uids] if return_prompt_caches else None,
        [tokens[uid] for uid in uids] if return_token_ids else None,
        [logprobs[uid] for uid in uids] if return_logprobs else None)
