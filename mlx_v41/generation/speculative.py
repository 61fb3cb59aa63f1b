"""DSpark speculative decoding: the drafter proposes up to 5 tokens after the anchor, one target
forward verifies them all, and the cache is trimmed back to what was accepted.

Greedy: the committed tokens are exactly plain greedy decoding's. Sampling: standard
speculative rejection sampling with the same warpers (temperature, top-p, min-p, top-k) on the
target's and the drafter's distributions, so the output is distributed as plain sampling. A
sampled cycle takes one key from the global random sequence and draws everything from keys
split off it, so every rank of a group advances its random state alike whatever it computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import mlx.core as mx

from ..cache.layer import transaction, trim_cache
from ..model.batch import batch_forward
from .group import ONE_PROCESS, ProcessGroup

MAX_DRAFT_TOKENS = 5  # the drafter's block holds the anchor and 5 proposals
KEY_WORD = 2 ** 31 - 1  # a drawn key's words stay below this (randint takes an int32 bound)


@dataclass(frozen=True)
class Sampling:
    """Sampler settings (mlx-lm's `make_sampler` arguments), usable as an mlx-lm sampler and,
    because its distribution is known, for exact speculative sampling. temp 0 is greedy."""

    temp: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    top_k: int = 0

    def logprobs(self, logprobs: mx.array) -> mx.array:
        """The log-distribution a draw uses: mlx-lm's filters, then the temperature."""
        from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

        if 0 < self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p:
            logprobs = apply_min_p(logprobs, self.min_p)
        if self.top_k > 0:
            logprobs = apply_top_k(logprobs, self.top_k)
        scaled = logprobs / self.temp
        return scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)

    def __call__(self, logprobs: mx.array) -> mx.array:
        if self.temp == 0:
            return mx.argmax(logprobs, axis=-1)
        return mx.random.categorical(self.logprobs(logprobs))


@dataclass
class DraftStats:
    """Drafts proposed and accepted, and verify cycles, of one stream."""

    proposed: int = 0
    accepted: int = 0
    cycles: int = 0

    @property
    def tokens_per_cycle(self) -> float:
        return (self.accepted + self.cycles) / max(self.cycles, 1)


def _require_drafter(model) -> None:
    if not model.drafting:
        raise ValueError("draft='dspark' needs the DSpark drafter: this model was loaded "
                         "without it (dspark=False, or a checkpoint without the mtp.* "
                         "tensors; dspark=True names what is missing)")


def check_draft_settings(model, sampler, num_draft_tokens: int) -> Sampling:
    """The settings speculative decoding runs with, or a ValueError naming what is missing."""
    _require_drafter(model)
    if not (isinstance(num_draft_tokens, int) and 1 <= num_draft_tokens <= MAX_DRAFT_TOKENS):
        raise ValueError(f"num_draft_tokens must be an int in 1..{MAX_DRAFT_TOKENS}, got "
                         f"{num_draft_tokens!r}")
    if sampler is None:
        return Sampling()
    if not isinstance(sampler, Sampling):
        raise ValueError("draft='dspark' samples exactly only with known settings: pass "
                         "sampler=mlx_v41.Sampling(temp, top_p, min_p, top_k)")
    return sampler


def speculative_steps(model, logits: mx.array, cache: list, *, sampling: Sampling,
                      max_tokens: int, stops: Sequence[int] = (), num_draft_tokens: int = 5,
                      draft_confidence: Optional[float] = None,
                      stats: Optional[DraftStats] = None, drafter=None,
                      logits_processors=None, history: Sequence[int] = (),
                      group: ProcessGroup = ONE_PROCESS) -> Iterator[tuple]:
    """(token, logprobs, from_draft) continuing from the prompt's last `logits` [1, 1, V],
    like `generate_step`: every yielded token has been fed to the cache, and the cache holds
    exactly the yielded tokens after the prompt (rejected and unyielded rows are trimmed).
    `drafter`: anything with `DSpark.draft`'s signature (default the model's; tests and the
    benchmark pass an oracle). `logits_processors` (mlx-lm's) shape every target row with
    the tokens before it (`history`: the prompt), as plain decoding does; the drafts' own
    distributions need no shaping, since acceptance compares them with the shaped target.
    `group`: the processes running the model; they continue with the drafts, acceptance and
    tokens of the one holding the logits (`generation.group`)."""
    if logits.shape[0] != 1:
        raise ValueError(f"speculative decoding runs one sequence per cache: logits have batch "
                         f"{logits.shape[0]} (run each sequence with its own cache)")
    drafter = model_drafter(model, drafter)
    spec = Speculation(logits, sampling=sampling, max_tokens=max_tokens, stops=stops,
                       processors=logits_processors, history=history, stats=stats,
                       group=group)
    while not spec.finish_reason:
        spec.draft(model, drafter, cache, num_draft_tokens, draft_confidence)
        block = spec.block(group)
        rows = model(mx.array([block]), cache=cache)[0]                   # [k + 1, V]
        yield from spec.settle(rows, cache, group)


def model_drafter(model, drafter=None):
    """The drafter a cycle runs: `drafter`, else the model's (None in a process of a group
    without it: that process takes the group's drafts); a model without one is refused."""
    if drafter is not None:
        return drafter
    _require_drafter(model)
    return model.dspark if "dspark" in model else None


class Speculation:
    """One sequence's speculative decoding between verify forwards: the anchor (sampled, not
    yet fed) and its log-probabilities, the drafts of the open cycle, the logits shaper and
    the stats. A cycle is `draft` -> `block` -> (the caller's verify forward over the block)
    -> `settle`; the batch engine runs many sequences' cycles side by side, one verify
    forward for all, so each sequence's tokens are its batch-1 tokens.

    Construction draws the first anchor from the prompt's last `logits` [1, 1, V] (one draw
    from the global random sequence, as plain sampling's first token)."""

    def __init__(self, logits: mx.array, *, sampling: Sampling, max_tokens: int,
                 stops: Sequence[int] = (), processors=None, history: Sequence[int] = (),
                 stats: Optional[DraftStats] = None, group: ProcessGroup = ONE_PROCESS):
        self.sampling, self.max_tokens, self.stops = sampling, max_tokens, set(stops)
        self.stats = stats if stats is not None else DraftStats()
        self.shape = _Shaper(processors, history)
        self.logprobs = _normalise(self.shape(logits[0, -1:], []))[0]
        self.anchor = group.agree_on_ints([_draw(sampling, self.logprobs)], 1)[0]
        self.done = 0  # tokens emitted (all fed)
        self.finish_reason = None if max_tokens > 0 else "length"
        self.drafts, self._pass, self._q, self._keys = [], None, None, (None, None)

    def draft(self, model, drafter, cache: list, num_draft_tokens: int,
              confidence: Optional[float] = None) -> None:
        """Open a cycle: take its random keys (one draw from the global sequence when
        sampling) and build the draft pass, lazily (`block` reads it)."""
        room = min(self.max_tokens - self.done,
                   model.cfg.max_position_embeddings - cache[0].offset) - 1
        # k <= room keeps anchor + accepted within max_tokens and the context.
        self._k, self._confidence = min(num_draft_tokens, room), confidence
        self._keys = _cycle_keys(self.sampling)
        self._pass = None
        if drafter is not None and self._k > 0:
            self._pass = _draft_pass(model, drafter, cache, self.anchor, self.sampling,
                                     self._keys[0])

    @property
    def pending(self) -> list:
        """The arrays the open cycle's draft pass computes (to evaluate many at once)."""
        return [] if self._pass is None else list(self._pass)

    def block(self, group: ProcessGroup = ONE_PROCESS) -> list:
        """The ids the verify forward feeds: [anchor, d1 .. dk]."""
        drafts, self._q = _read_drafts(self._pass, self.sampling, self._k, self._confidence)
        self.drafts = group.agree_on_ints(drafts, MAX_DRAFT_TOKENS)
        self._pass = None
        return [self.anchor] + self.drafts

    def settle(self, rows: mx.array, cache: list, group: ProcessGroup = ONE_PROCESS) -> list:
        """Accept or reject the drafts against the verify rows [k + 1, V] (the block's
        logits), trim the cache back to the kept tokens, and return them as (token, logprobs,
        from_draft), the anchor first. Afterwards `anchor` is the next one, or
        `finish_reason` says why the sequence ended ("stop", "length")."""
        anchor, drafts = self.anchor, self.drafts
        targets = _normalise(self.shape(rows, [anchor] + drafts))
        outcome = _accept(self.sampling, targets, drafts, self._q, self._keys[1]) \
            if group.has_logits else ([], 0)
        accepted, following = _agree_on_outcome(group, *outcome, drafts)
        accepted = _cut_at_stop(anchor, accepted, self.stops)
        trim_cache(cache, len(drafts) - len(accepted))
        self.stats.proposed += len(drafts)
        self.stats.accepted += len(accepted)
        self.stats.cycles += 1
        self.shape.extend([anchor] + accepted)
        emitted = [(anchor, self.logprobs, False)]
        emitted += [(token, targets[i], True) for i, token in enumerate(accepted)]
        self.done += len(emitted)
        if emitted[-1][0] in self.stops:
            self.finish_reason = "stop"
        elif self.done >= self.max_tokens:
            self.finish_reason = "length"
        self.logprobs, self.anchor = targets[len(accepted)], following
        self.drafts = []
        return emitted


def verify_blocks(model, specs: list, caches: list) -> list:
    """The verify rows [k + 1, V] of many sequences' open cycles (`Speculation.draft` done,
    `caches[b]` the cache of `specs[b]`): their draft passes evaluated together, then one
    `batch_forward` over every block. A block shorter than the longest (max_tokens or a
    confidence cut shortened its drafts) is padded with its last token to the longest length,
    and the padding's rows are trimmed from its cache after the forward: rows a causal
    forward computes after a block's own change none of its rows, and the trim is the one a
    rejected draft gets, so each sequence gets its bits alone. Only a block whose padding
    would pass the context's end runs apart, in a call per length. On any exception no
    cache changes."""
    mx.eval([array for spec in specs for array in spec.pending])
    blocks = [spec.block() for spec in specs]
    longest = max(len(block) for block in blocks)
    limit = model.cfg.max_position_embeddings
    fed = [block + [block[-1]] * (longest - len(block))
           if caches[b][0].offset + longest <= limit else block
           for b, block in enumerate(blocks)]
    by_length: dict = {}
    for b, ids in enumerate(fed):
        by_length.setdefault(len(ids), []).append(b)
    rows = [None] * len(specs)
    with transaction([layer for cache in caches for layer in cache]):
        for members in by_length.values():
            logits = batch_forward(model, mx.array([fed[b] for b in members]),
                                   [caches[b] for b in members]).logits
            for i, b in enumerate(members):
                rows[b] = logits[i, :len(blocks[b])]
                if len(fed[b]) > len(blocks[b]):
                    trim_cache(caches[b], len(fed[b]) - len(blocks[b]))
    return rows


class _Shaper:
    """mlx-lm logits processors applied row by row: row r of a verify forward predicts the token
    after the committed history and the first r + 1 tokens fed in that forward."""

    def __init__(self, processors, history: Sequence[int]):
        self.processors, self.history = list(processors or ()), list(history)

    def __call__(self, rows: mx.array, fed: list) -> mx.array:
        if not self.processors:
            return rows
        shaped = []
        for r in range(rows.shape[0]):
            tokens = mx.array(self.history + fed[:r + 1], dtype=mx.int32)
            row = rows[r:r + 1]
            for processor in self.processors:
                row = processor(tokens, row)
            shaped.append(row)
        return mx.concatenate(shaped, axis=0)

    def extend(self, tokens: list) -> None:
        self.history += tokens


def _normalise(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _draw(sampling: Sampling, logprobs: mx.array) -> int:
    return sampling(logprobs[None])[0].item()


def _cycle_keys(sampling: Sampling) -> tuple:
    """A sampled cycle's (draft key, acceptance key), split off one key taken from the global
    sequence (greedy: none taken). The number taken per cycle never depends on the data, so
    the ranks of a group, which start from the same seed, keep the same random state."""
    if sampling.temp == 0:
        return None, None
    return tuple(mx.random.split(_next_key()))


def _next_key() -> mx.array:
    """A key [2] uint32 from one draw of the global sequence (MLX has no public `next`)."""
    return mx.random.randint(0, KEY_WORD, (2,), mx.uint32)


def _draw_with(sampling: Sampling, key: mx.array):
    """`sample(row)` for the drafter: each call draws with the next key split off `key`."""
    keys = [key]

    def sample(row: mx.array) -> mx.array:
        keys[0], own = mx.random.split(keys[0])
        return mx.random.categorical(sampling.logprobs(_normalise(row)), key=own)

    return sample


def _draft_pass(model, drafter, cache: list, anchor: int, sampling: Sampling,
                key: Optional[mx.array] = None) -> tuple:
    """The drafter's (tokens, logits, confidence) after `anchor`, not yet evaluated."""
    sample = None if sampling.temp == 0 else _draw_with(sampling, key)
    return drafter.draft(model.model.embed_tokens, model.lm_head.weight, mx.array([anchor]),
                         cache[model.cfg.num_hidden_layers:], sample=sample)


def _read_drafts(draft_pass, sampling: Sampling, k: int, confidence: Optional[float]) -> tuple:
    """Up to `k` drafts of a draft pass and their proposal log-distributions [k, V]."""
    if draft_pass is None:
        return [], None
    tokens, logits, conf = draft_pass
    if confidence is not None:
        survival = mx.sum(mx.cumprod(mx.sigmoid(conf[0])) >= confidence)
        mx.eval(tokens, survival)  # one wait on the draft pass, not one per result
        k = min(k, int(survival.item()))
    q = None if sampling.temp == 0 else sampling.logprobs(_normalise(logits[0, :k]))
    return tokens[0, 1:k + 1].tolist(), q


def _accept(sampling: Sampling, targets: mx.array, drafts: list, q,
            key: Optional[mx.array] = None) -> tuple:
    """(accepted drafts, the token after them): greedy, the target's argmax; sampled, draft r is
    kept with probability min(1, p/q), the first rejected one is replaced by a draw from the
    residual max(p - q, 0), and after all drafts the next token is drawn from p. `key`: the
    cycle's (default: one from the global sequence)."""
    if sampling.temp == 0:
        best = mx.argmax(targets, axis=-1).tolist()
        n = 0
        while n < len(drafts) and drafts[n] == best[n]:
            n += 1
        return drafts[:n], best[n]
    uniform_key, draw_key = mx.random.split(_next_key() if key is None else key)
    logp = sampling.logprobs(targets)                                    # [k + 1, V]
    rows, ids = mx.arange(len(drafts)), mx.array(drafts, mx.int32)
    ratio = mx.exp(logp[rows, ids] - q[rows, ids]) if drafts else mx.zeros((0,))
    kept = (mx.random.uniform(shape=(len(drafts),), key=uniform_key) < ratio).tolist()
    n = kept.index(False) if False in kept else len(drafts)
    if n < len(drafts):
        residual = mx.maximum(mx.exp(logp[n]) - mx.exp(q[n]), 0)
        return drafts[:n], mx.random.categorical(mx.log(residual), key=draw_key).item()
    return drafts, mx.random.categorical(logp[n], key=draw_key).item()


def _agree_on_outcome(group: ProcessGroup, accepted: list, following: int,
                      drafts: list) -> tuple:
    """The acceptance every process trims by: that of the process holding the verify logits,
    as (accepted count, next token)."""
    n, token = group.agree_on_ints([len(accepted), following], 2)
    return drafts[:n], token


def _cut_at_stop(anchor: int, accepted: list, stops: Sequence[int]) -> list:
    """A stop token ends the reply: nothing after it (the anchor included) is committed."""
    if anchor in stops:
        return []
    for i, token in enumerate(accepted):
        if token in stops:
            return accepted[:i + 1]
    return accepted
