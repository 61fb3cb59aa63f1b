"""Perplexity over a local corpus, as mlx-lm's `perplexity` computes it: the corpus's documents in
a seeded order, tokenized and joined, cut into sequences of one length; perplexity is
exp(mean next-token loss) with the delta-method standard error of the per-token losses. The
quality check for conversion recipes, prefill modes and load-time overrides.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import numpy as np


class DataError(ValueError):
    """A corpus file that cannot give the sequences asked for; names the file (and line)."""


@dataclass
class Perplexity:
    """`evaluate_perplexity`'s result: perplexity and its standard error, the mean loss (nats)
    over `tokens` scored predictions, and the `positions` run through the model in
    `seconds`."""

    perplexity: float
    standard_error: float
    mean_loss: float
    tokens: int
    positions: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.positions / self.seconds if self.seconds > 0 else math.inf


def read_documents(path) -> list:
    """The documents of a corpus file: each line's "text" of a `.jsonl` file (blank lines
    skipped), else the whole file as one text. UTF-8 only."""
    path = Path(path)
    if path.is_dir():
        raise DataError(f"{path}: a directory, not a file")
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise DataError(f"{path}: line {line}: not valid UTF-8 (byte 0x{raw[e.start]:02x})"
                        ) from None
    if not text.strip():
        raise DataError(f"{path}: the file is empty")
    return _jsonl_documents(path, text) if path.suffix == ".jsonl" else [text]


def _jsonl_documents(path: Path, text: str) -> list:
    documents = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: line {number}: not valid JSON ({e.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise DataError(f'{path}: line {number}: no "text" field holding a string')
        documents.append(record["text"])
    return documents


def make_sequences(tokenizer, documents: list, sequence_length: int, num_samples: int = -1,
                   seed: int = 0, source: str = "the data") -> mx.array:
    """[N, sequence_length] int32: the documents in a seeded random order, each as BOS, its
    tokens and EOS, joined and cut into sequences (a partial last one dropped); the first
    `num_samples` (-1: all). A DataError naming `source` when not one sequence fills."""
    order = np.random.default_rng(seed).permutation(len(documents))
    wanted = sequence_length * num_samples if num_samples > 0 else math.inf
    tokens = []
    for index in order:
        if len(tokens) >= wanted:
            break
        tokens += tokenizer.encode_prompt(documents[index]) + [tokenizer.eos_token_id]
    count = min(len(tokens) // sequence_length, num_samples if num_samples > 0 else math.inf)
    if count == 0:
        raise DataError(f"{source}: {len(tokens)} tokens, fewer than one sequence of "
                        f"{sequence_length}")
    return mx.array(tokens[:count * sequence_length], dtype=mx.int32).reshape(
        count, sequence_length)


def token_losses(logits: mx.array, targets: mx.array) -> mx.array:
    """Cross-entropy [B, S] fp32 of logits [B, S, V] against the target ids [B, S]."""
    logits = logits.astype(mx.float32)
    picked = mx.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return mx.logsumexp(logits, axis=-1) - picked


def sequence_losses(model, batch: mx.array, context: int = 0,
                    step_size: Optional[int] = None) -> mx.array:
    """Next-token losses of the sequences batch [B, L]: [B, L - 1] for `context` 0, else
    [B, L - context] (`scored_logits`)."""
    return token_losses(scored_logits(model, batch, context, step_size)[0],
                        batch[:, max(context, 1):])


def scored_logits(model, batch: mx.array, context: int = 0, step_size: Optional[int] = None,
                  taps: tuple = ()) -> tuple:
    """(logits of the scored predictions of batch [B, L], the scoring forward's taps).
    `context` 0: every prediction, from one forward over every row ([B, L - 1, V]). Else the
    first `context` tokens are a prompt, prefilled with the model's prefill mode as
    generation does, and only the predictions after it count ([B, L - context, V]): its last
    logits, then a forward over the rest continuing its cache (the taps: that forward's)."""
    length = batch.shape[1]
    if not 0 <= context < length:
        raise ValueError(f"context must lie in [0, {length - 1}] for sequences of {length} "
                         f"tokens, got {context}")
    if context == 0:
        out = model.forward(batch[:, :-1], last_only=False, step_size=step_size, taps=taps)
        return out.logits, out.taps
    cache = model.make_cache()
    first = model.forward(batch[:, :context], cache, last_only=True, step_size=step_size).logits
    if context == length - 1:
        return first, None
    out = model.forward(batch[:, context:-1], cache, last_only=False, step_size=step_size,
                        taps=taps)
    return mx.concatenate([first, out.logits], axis=1), out.taps


def perplexity_stats(losses) -> tuple:
    """(perplexity, standard error) of per-token losses: exp(mean), and by the delta method
    exp(mean) * std / sqrt(n), std with Bessel's correction (mlx-lm's; NaN for one loss)."""
    losses = np.asarray(losses, dtype=np.float64).reshape(-1)
    ppl = math.exp(losses.mean())
    if losses.size < 2:
        return ppl, math.nan
    return ppl, ppl * losses.std(ddof=1) / math.sqrt(losses.size)


def evaluate_perplexity(model, data: mx.array, batch_size: int = 8, context: int = 0,
                        step_size: Optional[int] = None,
                        progress: Optional[Callable[[int, int], None]] = None) -> Perplexity:
    """Perplexity of `model` over the sequences `data` [N, L] in batches of `batch_size`
    (`sequence_losses` for `context`); `progress(done, total)` after each batch."""
    batches = -(-data.shape[0] // batch_size)
    losses, tic = [], time.perf_counter()
    for i in range(batches):
        part = sequence_losses(model, data[i * batch_size:(i + 1) * batch_size], context,
                               step_size)
        losses.append(np.array(part.astype(mx.float32)).reshape(-1))
        if progress is not None:
            progress(i + 1, batches)
    seconds = time.perf_counter() - tic
    losses = np.concatenate(losses)
    ppl, error = perplexity_stats(losses)
    return Perplexity(ppl, error, float(losses.astype(np.float64).mean()), int(losses.size),
                      data.shape[0] * (data.shape[1] - 1), seconds)
