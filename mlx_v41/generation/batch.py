"""Continuous batching: many sequences decoding together, each exactly as it would alone.

`BatchGenerator` is the incremental engine (mlx-lm's shape): `insert` prompts, call `next()`
once per step, `remove` a finished or cancelled sequence. A step

1. prefills queued prompts in paced pieces (`prompt_schedule.PromptSchedule` over
   `model.prefill.prefill_pieces`: chunks and CED halo layers, the bits of a batch-1
   prefill), the prompt with the least work left first,
   within the step's prompt budget (Sarathi-Serve's stall-free batching): while any sequence
   decodes, about one decode step's worth of prompt work (`PrefillPacer`), so a long prompt
   never stalls the replies already streaming and a short prompt behind it starts at once;
   with nothing decoding, `prefill_budget` in `prefill_step_size` chunks. With
   `prefill_thread=True` the long prompts' pieces run on a thread of their own
   (`prompt_thread.py`) while the step decodes, and the decode step never waits for them;
2. feeds every decoding sequence's last token in one batched forward
   (`model.batch.batch_forward`: one call, each row against its own cache), emits those
   tokens, and samples each sequence's next token with its own sampler, logits processors
   and random key.

With `draft="dspark"` step 2 is a speculative cycle instead: every decoding sequence drafts its
own block after its pending token, one `batch_forward` verifies all the blocks (k + 1 rows
each), and each sequence accepts, emits and trims its own (`speculative.Speculation`, the
batch-1 loop's acceptance), so it emits exactly its batch-1 DSpark tokens.

Each sequence lives in its own cache list; joining or leaving never copies another's. A
token is emitted once it has been fed to its cache (as `generate_step` does), so a finished
sequence's cache holds its prompt and every emitted token.

`batch_generate` (`batch_generate.py`) runs a list of prompts to the end, like mlx-lm's.
"""

from __future__ import annotations

import math
import time
from collections import deque
from contextlib import contextmanager
from typing import Callable, Optional, Sequence

import mlx.core as mx

from ..cache.layer import trim_cache, unshare_cache
from ..cache.persistence import copy_cache
from ..kernels.context import using
from ..model.batch import batch_forward
from ..model.expert_reader import ExpertReadError
from .api import DEFAULT_PREFILL_STEP_SIZE, check_context
from .pacing import MIN_PREFILL_CHUNK, PrefillPacer
from .prompt_schedule import PromptSchedule
from .prompt_thread import PromptThread, check_prefill_thread
from .sequence import BatchSequence, BatchStats, RandomKey, Response, random_stream
from .speculative import Speculation, check_draft_settings, model_drafter, verify_blocks


class BatchGenerator(PromptSchedule):
    """Continuous batching over one model (module docstring).

    Args:
        max_tokens: default most tokens per sequence.
        stop_tokens: token ids that end a sequence (default: none; `batch_generate` passes the
            tokenizer's EOS ids).
        sampler / logits_processors: defaults for sequences inserted without their own
            (greedy; none).
        completion_batch_size: most sequences decoding together (more wait, prefilled, for a
            slot); prompts being prefilled count too.
        prefill_batch_size: most prompts being prefilled at once.
        prefill_step_size: prompt tokens per prefill chunk (as `stream_generate`'s) at most.
        prefill_budget: prompt tokens prefilled per step while no sequence decodes (at least
            one piece runs when any prompt waits); default one chunk.
        decode_prefill_budget: prompt work per step while any sequence decodes: "auto"
            (default: about one decode step's time, `PrefillPacer`), a number of prompt
            tokens, or None for the old schedule (`prefill_budget` per step in
            `prefill_step_size` chunks, round-robin, the CED halo in one piece).
        min_prefill_chunk: the smallest "auto" budget, and the smallest chunk a step starts
            with what is left of its budget (tokens).
        on_prefilled: called as (uid, cache) when a prompt is in its cache, before its first
            token is fed (a server keeps the prompt's cache for reuse there).
        draft: "dspark" decodes speculatively (the model loaded with dspark=True; every
            sampler an `mlx_v41.Sampling`, greedy by default), with `num_draft_tokens` and
            `draft_confidence` as in `stream_generate`.
        pipelined: start each step's next tokens before reading back the tokens it feeds
            (default); False evaluates each step before it returns (the old step, the same
            tokens).
        prefill_thread: read long prompts on a thread of their own (with its own MLX stream)
            while the batch decodes, in pieces of up to `THREAD_PIECE` tokens; a prompt that
            fits one step's budget is read in the step. The same bits
            (`prompt_thread.PromptThread`); needs
            the paced schedule (`decode_prefill_budget` not None). `close()` when done.
            Not for a model split over ranks (each rank must run the same steps in order) or
            one whose experts stream from SSD (one expert cache).
    """

    def __init__(self, model, *, max_tokens: int = 128,
                 stop_tokens: Optional[Sequence[int]] = None, sampler=None,
                 logits_processors=None, completion_batch_size: int = 32,
                 prefill_batch_size: int = 8,
                 prefill_step_size: Optional[int] = DEFAULT_PREFILL_STEP_SIZE,
                 prefill_budget: Optional[int] = None,
                 decode_prefill_budget="auto", min_prefill_chunk: int = MIN_PREFILL_CHUNK,
                 on_prefilled: Optional[Callable[[int, list], None]] = None,
                 draft: Optional[str] = None, num_draft_tokens: int = 5,
                 draft_confidence: Optional[float] = None, pipelined: bool = True,
                 prefill_thread: bool = False):
        for name, value in (("completion_batch_size", completion_batch_size),
                            ("prefill_batch_size", prefill_batch_size),
                            ("min_prefill_chunk", min_prefill_chunk)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not (decode_prefill_budget in (None, "auto") or (
                isinstance(decode_prefill_budget, int) and decode_prefill_budget > 0)):
            raise ValueError(f"decode_prefill_budget must be 'auto', a positive int or None, "
                             f"got {decode_prefill_budget!r}")
        if prefill_thread:
            check_prefill_thread(model, decode_prefill_budget)
        from mlx_lm.sample_utils import greedy_sampler

        if draft not in (None, "dspark"):
            raise ValueError(f"draft must be None or 'dspark', got {draft!r}")
        if draft:
            sampler = check_draft_settings(model, sampler, num_draft_tokens)
        self.draft, self.pipelined = draft, pipelined
        self.drafter = model_drafter(model) if draft else None
        self.num_draft_tokens, self.draft_confidence = num_draft_tokens, draft_confidence
        self.model = model
        self.max_tokens = max_tokens
        self.stop_tokens = set(stop_tokens or ())
        self.sampler = sampler or greedy_sampler
        self.logits_processors = list(logits_processors or [])
        self.completion_batch_size = completion_batch_size
        self.prefill_batch_size = prefill_batch_size
        self.prefill_step_size = prefill_step_size
        self.prefill_budget = prefill_budget or prefill_step_size or 0
        self.pacer = None if decode_prefill_budget is None else PrefillPacer(
            decode_prefill_budget, min_prefill_chunk, prefill_step_size or math.inf)
        self.step_budget = 0.0  # the last step's prompt budget (tokens; inf: no limit)
        self._decode_seconds = None  # the last decode step's, for the pacer once complete
        self.on_prefilled = on_prefilled
        self.waiting: deque = deque()   # inserted, not yet prefilling
        self.prefilling: deque = deque()  # admission order (the old schedule's turns)
        self.decoding: list = []
        self._uid = 0
        self.counters = BatchStats()
        self.prompt_thread = PromptThread(model.kernels) if prefill_thread else None

    # ------------------------------------------------------------------ the API

    def insert(self, prompts: Sequence[Sequence[int]], max_tokens=None, caches=None,
               samplers=None, logits_processors=None, seeds=None, images=None,
               histories=None) -> list:
        """Queue prompts (token ids); their uids. Per prompt, optionally: `max_tokens`,
        `caches` (a cache holding a prefix; the prompt is appended to it in place),
        `samplers`, `logits_processors` (a list per prompt), `seeds` (the sequence then
        samples from its own random stream, as a batch-1 run after `mx.random.seed(seed)`),
        `images` (`vision.ImageInputs` of the prompt's spans), `histories` (the tokens the
        processors see before the reply; default the prompt: pass the whole prompt when a
        cache holds part of it). Bad arguments raise before anything is queued."""
        n = len(prompts)

        def per(name, values, default):
            if values is None:
                return [default] * n
            values = list(values)
            if len(values) != n:
                raise ValueError(f"{name} has {len(values)} entries for {n} prompts")
            return values

        max_tokens = per("max_tokens", [max_tokens] * n if isinstance(max_tokens, int)
                         else max_tokens, self.max_tokens)
        caches = per("caches", caches, None)
        samplers = per("samplers", samplers, None)
        processors = per("logits_processors", logits_processors, None)
        seeds = per("seeds", seeds, None)
        images = per("images", images, None)
        histories = per("histories", histories, None)
        made = []
        for i, prompt in enumerate(prompts):
            prompt = [int(t) for t in prompt]
            if not prompt:
                raise ValueError(f"prompts[{i}] is empty")
            cache = self.model.make_cache() if caches[i] is None else caches[i]
            check_context(self.model, cache[0].offset, len(prompt))
            if not isinstance(max_tokens[i], int) or max_tokens[i] < 0:
                raise ValueError(f"max_tokens[{i}] must be an int >= 0, got {max_tokens[i]!r}")
            room = self.model.args.text_config.max_position_embeddings - cache[0].offset \
                - len(prompt)
            key = None if seeds[i] is None else RandomKey(seeds[i])
            made.append(BatchSequence(
                0, prompt, cache, min(max_tokens[i], room), self._sampler(samplers[i]),
                list(self.logits_processors if processors[i] is None else processors[i]),
                key, images[i], history=mx.array(
                    prompt if histories[i] is None else [int(t) for t in histories[i]],
                    dtype=mx.int32)))
        uids = []
        for seq in made:
            seq.uid, self._uid = self._uid, self._uid + 1
            self.waiting.append(seq)
            uids.append(seq.uid)
        return uids

    def fork(self, uid: int, n: int, samplers=None, logits_processors=None,
             seeds=None) -> list:
        """`n` more sequences that share the prompt of `uid` (waiting or prefilling): once
        that prompt is in, each continues a copy of its cache, sampling its first token from
        the same logits with its own sampler, processors and seed (OpenAI's `n`: n replies,
        one prefill). Their uids. Removing `uid` before its prompt is in removes them too, and
        if its prompt fails, they fail with it."""
        parent = next((s for s in [*self.waiting, *self.prefilling] if s.uid == uid), None)
        if parent is None:
            raise ValueError(f"sequence {uid} is not waiting for its prompt: fork a sequence "
                             "before its prompt is in")
        samplers = samplers or [None] * n
        processors = logits_processors or [None] * n
        seeds = seeds or [None] * n
        if not len(samplers) == len(processors) == len(seeds) == n:
            raise ValueError(f"fork: samplers, logits_processors and seeds need {n} entries")
        uids = []
        for sampler, procs, seed in zip(samplers, processors, seeds):
            key = None if seed is None else RandomKey(seed)
            child = BatchSequence(self._uid, parent.prompt, None, parent.max_tokens,
                                  self._sampler(sampler),
                                  list(parent.processors if procs is None else procs), key,
                                  history=parent.history)
            self._uid += 1
            parent.forks.append(child)
            uids.append(child.uid)
        return uids

    def remove(self, uids, return_prompt_caches: bool = False) -> dict:
        """Drop sequences wherever they are (a prompt being prefilled is abandoned and its
        cache left as it was before); {uid: cache} with `return_prompt_caches`. Only a prompt
        the prompt thread reads waits for its piece in flight: the thread touches no other
        sequence, so dropping a reply or a request still waiting never pauses the batch."""
        uids, out = set(uids), {}
        if any(s.uid in uids and not s.on_main for s in self.prefilling):
            self._wait_for_prompts()  # no piece of a prompt being dropped is running
        for seq in [*self.waiting, *self.prefilling]:  # forks not branched yet
            seq.forks = [f for f in seq.forks if f.uid not in uids]
        for group in (self.waiting, self.prefilling, self.decoding):
            for seq in [s for s in group if s.uid in uids]:
                group.remove(seq)
                unshare_cache(seq.cache)
                if seq.steps is not None:
                    seq.steps.close()
                    seq.steps = None
                if return_prompt_caches:
                    out[seq.uid] = seq.cache
        return out

    def close(self) -> None:
        """Wait for the prompt job in flight (`prefill_thread`) and hand the prompt thread no
        more; the generator is not used after this."""
        if self.prompt_thread is not None:
            self.prompt_thread.close()

    def __len__(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.decoding)

    @property
    def sequences(self) -> list:
        """Every sequence held: waiting, prefilling, decoding."""
        return [*self.waiting, *self.prefilling, *self.decoding]

    @contextmanager
    def stats(self):
        """The work done while the block runs (`BatchStats`)."""
        stats, before = BatchStats(), BatchStats(**vars(self.counters))
        mx.reset_peak_memory()
        try:
            yield stats
        finally:
            for name in ("prompt_tokens", "prompt_time", "generation_tokens",
                         "generation_time", "drafts_proposed", "drafts_accepted"):
                setattr(stats, name, getattr(self.counters, name) - getattr(before, name))
            stats.peak_memory = mx.get_peak_memory() / 1e9

    def next(self) -> list:
        """One step: prefill chunks, then one batched decode step; the `Response`s emitted
        (a sequence's tokens in order; finished sequences have left the batch)."""
        responses = []
        with using(self.model.kernels):
            responses += self._admit()
            if self.prefilling:  # the prompt's time is its own, not the decode in flight's
                self._decode_done()
            responses += self._prefill()
            responses += self._speculate() if self.draft else self._decode()
        return responses

    # ------------------------------------------------------------------ the steps

    def _start_decoding(self, seq, logits) -> None:
        """The prompt is in: sample its first token; the sequence joins the decode batch."""
        if self.on_prefilled is not None:
            self.on_prefilled(seq.uid, seq.cache)
        forks, seq.forks = seq.forks, []
        for child in forks:  # copies share the arrays: nothing is copied until they differ
            child.cache = copy_cache(seq.cache)
        for one in (seq, *forks):
            if one.max_tokens == 0:
                one.finish_reason = "length"
            elif self.draft:
                with random_stream(one.key):
                    one.spec = Speculation(logits[:, -1:, :], sampling=one.sampler,
                                           max_tokens=one.max_tokens, stops=self.stop_tokens,
                                           processors=one.processors,
                                           history=one.history.tolist())
            else:
                self._sample(one, logits[:, -1, :])
            self.decoding.append(one)

    def _sampler(self, sampler):
        """A sequence's sampler (the default when None); drafting needs a `Sampling`."""
        sampler = sampler or self.sampler
        if self.draft:
            check_draft_settings(self.model, sampler, self.num_draft_tokens)
        return sampler

    def _sample(self, seq, logits) -> None:
        """Sample the next token from `logits` [1, V] as `generate_step` does."""
        seq.token, seq.logprobs = self._draw(seq, logits)

    def _draw(self, seq, logits) -> tuple:
        """(token [1], logprobs [V]) sampled from `logits` [1, V] with the sequence's
        processors, sampler and random stream (lazy: nothing is evaluated)."""
        for processor in seq.processors:
            logits = processor(seq.history, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        with random_stream(seq.key):
            token = seq.sampler(logprobs)
        if seq.processors:
            seq.history = mx.concatenate([seq.history, token.astype(mx.int32)])
        return token, logprobs[0]

    def _decode(self) -> list:
        """Feed every decoding sequence's token in one forward, emit it, sample the next:
        pipelined (`_sample_ahead`), so the next step's graph is built while this one runs."""
        batch = [s for s in self.decoding if s.token is not None]
        responses = [self._finish(s) for s in
                     [s for s in self.decoding if s.token is None]]
        if not batch:
            return responses
        tic = time.perf_counter()
        try:
            parts = [(batch, self._forward(batch))]
        except ExpertReadError:  # a damaged expert file: only the sequences routed to it fail
            parts = []
            for seq in batch:  # a failed forward changed no cache
                try:
                    parts.append(([seq], self._forward([seq])))
                except ExpertReadError as e:
                    responses += self._fail(seq, e)
        ahead = self._sample_ahead(parts) if self.pipelined else {}
        for part, logits in parts:
            responses += self._emit_decoded(part, logits, ahead)
        decoded = [s for part, _ in parts for s in part]
        start = mx.async_eval if self.pipelined else mx.eval
        start([x for s in decoded if s.finish_reason is None and s.token is not None
               for x in (s.token, s.logprobs)])
        self.counters.generation_tokens += len(decoded)
        self._timed_decode(tic)
        return responses

    def _sample_ahead(self, parts: list) -> dict:
        """{id(sequence): (token, logprobs)} of the next tokens that need no value of this step's:
        every sequence without logits processors whose fed token is not its last, sampled
        from the forward's graph and started at once (`mx.async_eval`, as `generate_step`
        pipelines), before this step's tokens are read back. A sequence whose token turns
        out to be a stop token drops its sample (an unseeded one has drawn from the global
        stream); one with processors samples once its token is known (they read it)."""
        ahead = {}
        for part, logits in parts:
            for b, seq in enumerate(part):
                if seq.processors or seq.generated + 1 >= seq.max_tokens:
                    continue
                try:
                    ahead[id(seq)] = self._draw(seq, logits[b:b + 1, -1, :])
                except Exception:  # sampled again (and failed alone) once its token is read
                    continue
        mx.async_eval([x for drawn in ahead.values() for x in drawn])
        return ahead

    def _timed_decode(self, tic: float) -> None:
        """Count a decode step's time; the pacer gets it with the wait for its forward
        (`_decode_done`) at the next step's start."""
        seconds = time.perf_counter() - tic
        self.counters.generation_time += seconds
        if self.pacer is not None:
            if self._decode_seconds is not None:  # the step before's, now complete
                self.pacer.decoded(self._decode_seconds)
            self._decode_seconds = seconds

    def _decode_done(self) -> None:
        """Wait for the decode step in flight (the next tokens being computed), counted as
        decode time."""
        tic = time.perf_counter()
        mx.eval([x for s in self.decoding if s.token is not None for x in (s.token, s.logprobs)])
        seconds = time.perf_counter() - tic
        self.counters.generation_time += seconds
        self._decode_seconds = None if self._decode_seconds is None else \
            self._decode_seconds + seconds

    def _forward(self, batch: list) -> mx.array:
        ids = mx.concatenate([s.token.reshape(1, 1) for s in batch], axis=0)
        return batch_forward(self.model, ids, [s.cache for s in batch]).logits

    def _emit_decoded(self, batch: list, logits: mx.array, ahead: dict) -> list:
        """Emit each sequence's fed token and take its next: sampled ahead, or sampled now
        from its row of `logits`."""
        responses = []
        for b, seq in enumerate(batch):
            token = seq.token.item()
            seq.generated += 1
            if token in self.stop_tokens:
                seq.finish_reason = "stop"
            elif seq.generated >= seq.max_tokens:
                seq.finish_reason = "length"
            response = Response(seq.uid, token, seq.logprobs)
            if seq.finish_reason is None:
                try:
                    if id(seq) in ahead:
                        seq.token, seq.logprobs = ahead[id(seq)]
                    else:
                        self._sample(seq, logits[b:b + 1, -1, :])
                except Exception as e:  # a processor or sampler that raises
                    responses.append(response)
                    responses += self._fail(seq, e)
                    continue
            else:
                response = self._finish(seq, response)
            responses.append(response)
        return responses

    def _speculate(self) -> list:
        """One speculative cycle of every decoding sequence: each drafts after its pending
        token, one verify forward runs all the blocks, each keeps what it accepts."""
        batch = [s for s in self.decoding if s.spec is not None]
        responses = [self._finish(s) for s in [s for s in self.decoding if s.spec is None]]
        if not batch:
            return responses
        tic, seeds = time.perf_counter(), [s.key and s.key.seed for s in batch]
        try:
            for seq in batch:
                with random_stream(seq.key):  # the cycle's key: one draw from its own stream
                    seq.spec.draft(self.model, self.drafter, seq.cache, self.num_draft_tokens,
                                   self.draft_confidence)
            rows = verify_blocks(self.model, [s.spec for s in batch], [s.cache for s in batch])
        except BaseException:  # no cache changed: nor does any random stream
            for seq, seed in zip(batch, seeds):
                if seq.key is not None:
                    seq.key.seed = seed
            raise
        for seq, seq_rows in zip(batch, rows):
            responses += self._settle(seq, seq_rows)
        self._timed_decode(tic)
        return responses

    def _settle(self, seq, rows: mx.array) -> list:
        """The sequence's accepted tokens of its verify `rows`, one `Response` each."""
        spec, proposed = seq.spec, len(seq.spec.drafts)
        try:
            emitted = spec.settle(rows, seq.cache)
        except Exception as e:  # a processor that raises: the anchor was fed, the drafts go
            trim_cache(seq.cache, proposed)
            return [Response(seq.uid, spec.anchor, spec.logprobs), *self._fail(seq, e)]
        seq.generated += len(emitted)
        self.counters.generation_tokens += len(emitted)
        self.counters.drafts_proposed += proposed
        self.counters.drafts_accepted += len(emitted) - 1
        responses = [Response(seq.uid, token, logprobs, from_draft=from_draft,
                              draft_stats=spec.stats) for token, logprobs, from_draft in emitted]
        if spec.finish_reason is not None:
            seq.finish_reason = spec.finish_reason
            responses[-1] = self._finish(seq, responses[-1])
        return responses

    def _finish(self, seq, response: Optional[Response] = None) -> Response:
        if seq in self.decoding:
            self.decoding.remove(seq)
        unshare_cache(seq.cache)  # its rings were rows of the batch's stacked rings
        response = response or Response(seq.uid, -1, None)
        response.finish_reason = seq.finish_reason or "length"
        response.prompt_cache = seq.cache
        return response

    def _fail(self, seq, error: BaseException) -> list:
        """The sequence leaves with an "error" response (and so do its forks not yet
        branched: they share its prompt)."""
        for group in (self.prefilling, self.decoding):
            if seq in group:
                group.remove(seq)
        unshare_cache(seq.cache)
        forks, seq.forks = seq.forks, []
        return [Response(one.uid, -1, None, "error", one.cache, error) for one in (seq, *forks)]
