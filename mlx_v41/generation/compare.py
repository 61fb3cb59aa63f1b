"""How far a test setting's outputs are from a reference setting's on the same token sequences:
teacher-forced KL(reference ‖ test), top-1 agreement and log-probability deltas; the divergence
ladder of the residual streams entering each block (the forward's taps); and free-running
greedy decoding until the first difference. The reference runs first and leaves a
`ReferenceRecord` (its top-k log-probabilities and stream rows), so the two models need not be
resident at once.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx
import numpy as np

from .api import generate_step, prefill
from .perplexity import perplexity_stats, scored_logits
from .prompt_reuse import common_prefix

# Default reference log-probabilities kept per position (0: the whole vocabulary, exact KL).
DEFAULT_KL_TOP_K = 128
# Prompt tokens of the untimed warm-up run before the free-running prompts are timed.
WARMUP_TOKENS = 16


class CompareError(ValueError):
    """The test and the reference cannot be compared (another vocabulary or tokenization)."""


@dataclass
class ReferenceRecord:
    """What the reference leaves for the comparison, per scored position p (P in all):

    data [N, L] int32 ids; top_ids [P, K] int32 and top_logprobs [P, K] float32 of its K most
    probable tokens (top_ids None: every token, K = vocab, exact KL); argmax [P] and
    argmax_logprob [P]; target_logprob [P] of the data's next token; ladder: layer ->
    [rows, D] float32 streams entering the block for the first `ladder_samples` sequences;
    tokens: the greedy continuation of each free-running prompt."""

    vocab_size: int
    data: np.ndarray
    context: int
    ladder_samples: int
    top_ids: Optional[np.ndarray]
    top_logprobs: np.ndarray
    argmax: np.ndarray
    argmax_logprob: np.ndarray
    target_logprob: np.ndarray
    ladder: dict
    prompts: list
    tokens: list
    speed: dict

    @property
    def is_exact(self) -> bool:
        return self.top_ids is None


@dataclass
class Comparison:
    """`compare`'s result. KL in nats per position (`kl_exact`: over the whole vocabulary;
    else over the reference's top-k tokens plus one bucket for the rest, a lower bound);
    deltas are test minus reference; ladder rows: (layer, relative RMS, mean cosine);
    first_difference: per free-running prompt, the greedy tokens before the first difference
    (max_tokens when none)."""

    positions: int
    kl_exact: bool
    kl_mean: float
    kl_p99: float
    kl_max: float
    top1_agreement: float
    argmax_logprob_delta: float
    target_logprob_delta: float
    perplexity: float
    reference_perplexity: float
    ladder: list
    first_difference: list
    max_tokens: int
    speed: dict = field(default_factory=dict)
    reference_speed: dict = field(default_factory=dict)

    @property
    def longest_common_prefix(self) -> int:
        return max(self.first_difference, default=0)

    @property
    def mean_first_difference(self) -> float:
        return float(np.mean(self.first_difference)) if self.first_difference else math.nan

    def as_dict(self) -> dict:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["ladder"] = [{"layer": layer, "relative_rms": rms, "cosine": cos}
                         for layer, rms, cos in self.ladder]
        out["longest_common_prefix"] = self.longest_common_prefix
        out["mean_first_difference"] = self.mean_first_difference
        return out


def _scored(model, batch: mx.array, context: int, step_size: Optional[int], taps: tuple):
    """`perplexity.scored_logits`, with a scoring forward (so taps) after any prompt."""
    length = batch.shape[1]
    if not 0 <= context < length - 1:
        raise ValueError(f"context must lie in [0, {length - 2}] for sequences of {length} "
                         f"tokens, got {context}")
    return scored_logits(model, batch, context, step_size, taps)


def _log_softmax(logits: mx.array) -> mx.array:
    """[P, V] float32 log-probabilities of logits [B, S, V]."""
    logits = logits.astype(mx.float32).reshape(-1, logits.shape[-1])
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _gather(logprobs: mx.array, ids) -> np.ndarray:
    ids = mx.array(ids)
    return np.array(mx.take_along_axis(logprobs, ids.reshape(ids.shape[0], -1), axis=-1))


def _top_k(logprobs: mx.array, k: int) -> tuple:
    """ids [P, k] and log-probabilities of the k most probable tokens, most probable first."""
    ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
    values = mx.take_along_axis(logprobs, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)
    ids = mx.take_along_axis(ids, order, axis=-1)
    return np.array(ids.astype(mx.int32)), np.array(mx.take_along_axis(values, order, axis=-1))


def _batches(data: mx.array, batch_size: int):
    for start in range(0, data.shape[0], batch_size):
        yield start, data[start:start + batch_size]


def _ladder_taps(model, start: int, ladder_samples: int) -> tuple:
    return tuple(range(model.cfg.num_hidden_layers)) if start < ladder_samples else ()


def _ladder_rows(taps: dict, keep: int) -> dict:
    """layer -> [rows, D] float32 of the first `keep` sequences' tapped streams."""
    return {layer: np.array(t[:keep].astype(mx.float32)).reshape(-1, t.shape[-1])
            for layer, t in taps.items()}


def _merge(ladder: dict, rows: dict) -> None:
    for layer, value in rows.items():
        ladder[layer] = value if layer not in ladder else np.concatenate([ladder[layer], value])


def greedy_tokens(model, prompt: list, max_tokens: int, step_size: Optional[int] = None
                  ) -> tuple:
    """(the greedy continuation of `prompt`, `max_tokens` ids, prefill seconds, decode
    seconds): the prompt prefilled with the model's prefill mode, as generation runs it."""
    cache = model.make_cache()
    tic = time.perf_counter()
    logits = prefill(model, prompt, cache, step_size)
    middle = time.perf_counter()
    tokens = [token for token, _ in generate_step(model, logits, cache, max_tokens=max_tokens)]
    return tokens, middle - tic, time.perf_counter() - middle


def free_run(model, prompts: list, max_tokens: int, step_size: Optional[int] = None) -> tuple:
    """(each prompt's greedy continuation, speeds: prefill and decode tokens per second over
    all the prompts, after a short warm-up run that is not timed)."""
    if not prompts:
        return [], {}
    greedy_tokens(model, prompts[0][:WARMUP_TOKENS], 2, step_size)
    runs = [greedy_tokens(model, p, max_tokens, step_size) for p in prompts]
    speed = {"prefill_tps": sum(map(len, prompts)) / sum(r[1] for r in runs),
             "decode_tps": max_tokens * len(runs) / sum(r[2] for r in runs)}
    return [r[0] for r in runs], speed


def record_reference(model, data: mx.array, *, context: int = 0, batch_size: int = 8,
                     kl_top_k: int = DEFAULT_KL_TOP_K, ladder_samples: int = 1,
                     prompts: tuple = (), max_tokens: int = 32,
                     step_size: Optional[int] = None) -> ReferenceRecord:
    """Run the reference over `data` [N, L] (the scored positions as `scored_logits`) and the
    free-running `prompts` (lists of ids); keep what `compare` needs.

    Args:
        kl_top_k: reference log-probabilities kept per position; 0 or >= the vocabulary: all
            of them (exact KL, P x V floats).
        ladder_samples: sequences whose streams enter the ladder (all their scored rows).
    """
    vocab = model.cfg.vocab_size
    k = 0 if kl_top_k <= 0 or kl_top_k >= vocab else kl_top_k
    parts, ladder = [], {}
    for start, batch in _batches(data, batch_size):
        logits, taps = _scored(model, batch, context, step_size,
                               _ladder_taps(model, start, ladder_samples))
        parts.append(_kept(_log_softmax(logits), _targets(batch, context), k))
        _merge(ladder, _ladder_rows(taps, ladder_samples - start))
    top_ids, top_logprobs, argmax, argmax_lp, target_lp = (
        np.concatenate(column) if column[0] is not None else None for column in zip(*parts))
    tokens, speed = free_run(model, list(prompts), max_tokens, step_size)
    return ReferenceRecord(vocab, np.array(data), context, ladder_samples, top_ids,
                           top_logprobs, argmax, argmax_lp, target_lp, ladder,
                           [list(p) for p in prompts], tokens, speed)


def _kept(logprobs: mx.array, targets: mx.array, k: int) -> tuple:
    """What the record keeps of one batch's log-probabilities [P, V]: (top ids or None,
    their log-probabilities or all of them, argmax, its log-probability, the target's)."""
    argmax = mx.argmax(logprobs, axis=-1)
    top = _top_k(logprobs, k) if k else (None, np.array(logprobs))
    return (*top, np.array(argmax.astype(mx.int32)), _gather(logprobs, argmax)[:, 0],
            _gather(logprobs, targets.reshape(-1))[:, 0])


def _targets(batch: mx.array, context: int) -> mx.array:
    """The data's next tokens of the scored predictions [B, L - 1 or L - context]."""
    return batch[:, max(context, 1):]


def kl_terms(reference: np.ndarray, test: np.ndarray, is_exact: bool) -> np.ndarray:
    """KL(p ‖ q) [P] in nats, float64, from log-probabilities [P, K] of the same tokens: over
    them when they are the whole vocabulary, else plus one bucket for the tokens left out
    (mass 1 - the kept mass on each side): a lower bound of the full KL (merging tokens cannot
    raise it), exact when the reference's mass outside the k tokens is 0."""
    lp, lq = reference.astype(np.float64), test.astype(np.float64)
    p = np.exp(lp)
    kl = np.sum(p * (lp - lq), axis=-1)
    if is_exact:
        return kl
    p_tail = np.clip(1.0 - p.sum(-1), 0.0, 1.0)
    q_tail = np.clip(1.0 - np.exp(lq).sum(-1), np.finfo(np.float64).tiny, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        tail = np.where(p_tail > 0, p_tail * (np.log(p_tail) - np.log(q_tail)), 0.0)
    return kl + tail


def check_comparable(model, record: ReferenceRecord) -> None:
    """A CompareError unless the model's vocabulary is the reference's."""
    vocab = model.cfg.vocab_size
    if vocab != record.vocab_size:
        raise CompareError(f"the test model's vocabulary has {vocab} tokens, the reference's "
                           f"{record.vocab_size}: their logits cannot be compared")


def check_same_tokens(data: np.ndarray, reference: np.ndarray) -> None:
    """A CompareError unless the test tokenizer gave the reference's ids for the data."""
    if data.shape == reference.shape and np.array_equal(data, reference):
        return
    if data.shape != reference.shape:
        raise CompareError(f"the test tokenizer cuts the data into {data.shape[0]} sequences "
                           f"of {data.shape[1]}, the reference's into {reference.shape[0]}: "
                           "the two tokenizers differ")
    row, col = np.argwhere(data != reference)[0]
    raise CompareError(f"the test tokenizer gives token {data[row, col]} where the "
                       f"reference's gives {reference[row, col]} (sequence {row}, position "
                       f"{col}): the two tokenizers differ")


def ladder(record: ReferenceRecord, rows: dict) -> list:
    """(layer, relative RMS ‖t - r‖ / ‖r‖ over all rows, mean over rows of cos(t, r)) per
    tapped layer, in float64 (identical streams give exactly 0 and 1)."""
    out = []
    for layer in sorted(record.ladder):
        r = record.ladder[layer].astype(np.float64)
        t = rows[layer].astype(np.float64)
        rr, tt = np.einsum("nd,nd->n", r, r), np.einsum("nd,nd->n", t, t)
        rms = math.sqrt(np.sum((t - r) ** 2) / max(np.sum(rr), np.finfo(np.float64).tiny))
        with np.errstate(divide="ignore", invalid="ignore"):
            cos = np.where(rr * tt > 0, np.einsum("nd,nd->n", t, r) / np.sqrt(rr * tt), 1.0)
        out.append((layer, rms, float(np.mean(cos))))
    return out


def compare(model, record: ReferenceRecord, *, batch_size: int = 8,
            step_size: Optional[int] = None) -> Comparison:
    """Run the test `model` over the reference's data and prompts, the same way, and compare
    (see `Comparison`). Raises CompareError for another vocabulary."""
    check_comparable(model, record)
    data, context = mx.array(record.data), record.context
    ladder_samples = record.ladder_samples
    kl, agree, argmax_lp, target_lp, rows, done = [], [], [], [], {}, 0
    for start, batch in _batches(data, batch_size):
        logits, taps = _scored(model, batch, context, step_size,
                               _ladder_taps(model, start, ladder_samples))
        logprobs = _log_softmax(logits)
        n = logprobs.shape[0]
        span = slice(done, done + n)
        test = _gather(logprobs, record.top_ids[span]) if not record.is_exact \
            else np.array(logprobs)
        kl.append(kl_terms(record.top_logprobs[span], test, record.is_exact))
        agree.append(np.array(mx.argmax(logprobs, axis=-1)) == record.argmax[span])
        argmax_lp.append(_gather(logprobs, record.argmax[span])[:, 0])
        target_lp.append(_gather(logprobs, _targets(batch, context).reshape(-1))[:, 0])
        _merge(rows, _ladder_rows(taps, ladder_samples - start))
        done += n
    kl, agree = np.concatenate(kl), np.concatenate(agree)
    argmax_lp, target_lp = np.concatenate(argmax_lp), np.concatenate(target_lp)
    max_tokens = len(record.tokens[0]) if record.tokens else 0
    tokens, speed = free_run(model, record.prompts, max_tokens, step_size)
    return Comparison(
        positions=int(kl.size), kl_exact=record.is_exact, kl_mean=float(kl.mean()),
        kl_p99=float(np.percentile(kl, 99)), kl_max=float(kl.max()),
        top1_agreement=float(agree.mean()),
        argmax_logprob_delta=_mean_delta(argmax_lp, record.argmax_logprob),
        target_logprob_delta=_mean_delta(target_lp, record.target_logprob),
        perplexity=_perplexity(target_lp), reference_perplexity=_perplexity(
            record.target_logprob),
        ladder=ladder(record, rows) if record.ladder else [],
        first_difference=[common_prefix(a, b) for a, b in zip(tokens, record.tokens)],
        max_tokens=max_tokens, speed=speed, reference_speed=record.speed)


def _mean_delta(test: np.ndarray, reference: np.ndarray) -> float:
    return float(np.mean(test.astype(np.float64) - reference.astype(np.float64)))


def _perplexity(target_logprob: np.ndarray) -> float:
    return perplexity_stats(-target_logprob)[0]
