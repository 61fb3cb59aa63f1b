"""The batching engine: every request joins one running batch (`generation.batch.BatchGenerator`)
at the next step and leaves it when done, cancelled or disconnected (its slot is free at once).

One worker thread runs the steps: take new requests, drop cancelled ones, admit waiting ones
while their caches fit the KV budget, run one step (prompt chunks, then one batched decode
step), and hand each token to its request. A request's prompt is prefilled in chunks between
decode steps, so a long prompt never stalls the replies already streaming, and a client that
leaves mid-prompt frees the worker at the next chunk. Each sequence decodes exactly as it would
alone (same tokens as the one-at-a-time `Engine`, greedy or with its seed, with or without
DSpark drafts: with `draft`, one step is a speculative cycle of every sequence); one that
fails (a bad image, a processor that raises) fails alone.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx

from ...generation.api import DEFAULT_PREFILL_STEP_SIZE, wired_limit
from ...generation.batch import BatchGenerator
from ...model.memory import session_bytes
from ...model.vision.prompt import ImagePrompt
from .serial import Engine, Finish, Job, StopStrings, Token
from .prompt_store import align_to_tokens
from ..errors import RequestError

log = logging.getLogger("mlx_v41.server")

DEFAULT_DECODE_CONCURRENCY = 32  # mlx-lm's server defaults
DEFAULT_PROMPT_CONCURRENCY = 8


def default_kv_budget(model, prompt_cache_bytes: int = 0) -> int:
    """Bytes the running sequences' caches may take: 90 % of the machine's memory left beside
    the weights (streamed experts: their slots) and the prompt-cache store (the machine's
    memory as MLX reports it on a Mac, else the physical memory)."""
    import os

    from ...model.memory import resident_bytes

    try:
        total = mx.device_info()["memory_size"]
    except Exception:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(int(0.9 * (total - resident_bytes(model) - prompt_cache_bytes)), 0)


@dataclass
class _Running:
    """A request in the batch: its job, its cache state, what it has emitted."""

    job: Job
    state: object                     # the store's PromptCache the sequence continues
    cached: int                       # prompt tokens the store had
    todo: list                        # prompt tokens to prefill
    reserved: int                     # bytes its cache may reach (KV budget)
    detokenizer: object
    stops: StopStrings
    tic: float = field(default_factory=time.perf_counter)
    prefill_seconds: float = 0.0
    snapshot: object = None           # the prompt's cache, kept for reuse
    tokens: list = field(default_factory=list)
    prefilled: Optional[int] = None   # prompt tokens read when it was cancelled mid-prompt


class BatchEngine(Engine):
    """An `Engine` that batches (module docstring).

    Args:
        decode_concurrency: most sequences decoding together (mlx-lm's
            `--decode-concurrency`).
        prompt_concurrency: most prompts being prefilled at once (`--prompt-concurrency`).
        kv_budget: bytes the running sequences' caches may take together (each counted at its
            prompt + max_tokens, `model.memory.session_bytes`); a request waits until it fits.
            None: `default_kv_budget`.
        decode_prefill_budget: prompt work a step does while sequences decode
            (`BatchGenerator`'s: "auto", tokens, or None for one chunk a step).
        prefill_thread: read long prompts on a thread of their own while the batch decodes
            (`BatchGenerator`'s).
        max_concurrent: requests queued or running at most (more get EngineBusy: HTTP 429).
        Others as `Engine`'s.
    """

    def __init__(self, model, tokenizer, store, *,
                 decode_concurrency: int = DEFAULT_DECODE_CONCURRENCY,
                 prompt_concurrency: int = DEFAULT_PROMPT_CONCURRENCY,
                 kv_budget: Optional[int] = None, decode_prefill_budget="auto",
                 prefill_thread: bool = False, **options):
        super().__init__(model, tokenizer, store, **options)
        self.kv_budget = default_kv_budget(model, store.max_bytes) if kv_budget is None \
            else kv_budget
        self.generator = BatchGenerator(
            model, stop_tokens=tokenizer.eos_token_ids,
            completion_batch_size=decode_concurrency, prefill_batch_size=prompt_concurrency,
            prefill_step_size=self.prefill_step_size or DEFAULT_PREFILL_STEP_SIZE,
            decode_prefill_budget=decode_prefill_budget, on_prefilled=self._prefilled,
            prefill_thread=prefill_thread, **self.draft)  # DSpark: every request drafts
        self.counters = self.generator.counters  # the drafts, for the metrics
        self.waiting: deque = deque()  # submitted, not yet in the batch (by arrival)
        self.running: dict = {}  # uid -> _Running
        self.steps = 0  # batch steps run
        self.peak_batch = 0  # most requests in the batch at once

    @property
    def kv_reserved(self) -> int:
        """Bytes the running sequences hold of the KV budget (read from any thread)."""
        return sum(run.reserved for run in list(self.running.values()))

    def reserve(self, prompt_tokens: int, max_tokens: int) -> int:
        """Bytes a request's cache may reach: its prompt, every token it may generate and,
        decoding speculatively, the drafts a verify holds before they are trimmed."""
        drafts = self.draft.get("num_draft_tokens", 0) if self.draft else 0
        return session_bytes(self.model.cfg, prompt_tokens + max_tokens + drafts,
                             self.model.drafting)

    def submit_many(self, prompt, settings: list) -> list:
        """One job per choice (OpenAI's `n`); the first one's prefill serves them all (the
        others are forks of its sequence, `BatchGenerator.fork`)."""
        jobs = super().submit_many(prompt, settings)
        jobs[0].siblings = jobs[1:]
        return jobs

    def submit(self, prompt, settings) -> Job:
        length = len(prompt.ids if isinstance(prompt, ImagePrompt) else prompt)
        need = self.reserve(length, settings.max_tokens)
        if need > self.kv_budget:  # it could never run: refuse it rather than queue it
            raise RequestError(f"the request's cache would take {need:,} bytes (its prompt and "
                               f"max_tokens), more than the server's KV budget of "
                               f"{self.kv_budget:,} bytes (--kv-budget)", param="max_tokens",
                               code="context_length_exceeded")
        return super().submit(prompt, settings)

    # ------------------------------------------------------------------ worker thread

    def _work(self) -> None:
        self._load_store()
        stopping = False
        with wired_limit(self.model):
            while not stopping or self.running or self.waiting:
                stopping = self._take(block=not self.running and not self.waiting
                                      and not stopping) or stopping
                with self.lock:  # held while the model runs (as the serial engine's)
                    try:
                        self._drop_cancelled()
                        self._admit()
                        if self.running:
                            self._step()
                            self.steps += 1
                            self.peak_batch = max(self.peak_batch, len(self.running))
                    except Exception as e:  # a bug of ours: fail what runs, keep serving
                        log.exception("batch engine step failed")
                        self._fail_running(e)
                if not self.running and not self.waiting:
                    self._flush()  # new prompt caches go to disk while the batch is idle
        self.generator.close()  # the prompt thread, if any
        self._end_worker()

    def _take(self, block: bool) -> bool:
        """Move submitted jobs to `waiting`; True once `close` asked the worker to stop."""
        stopping = False
        while True:
            try:
                job = self._queue.get(block=block)
            except queue.Empty:
                return stopping
            block = False
            if job is None:
                stopping = True
            else:
                self.waiting.append(job)

    def _drop_cancelled(self) -> None:
        for job in [j for j in self.waiting if j.cancelled.is_set()]:
            self.waiting.remove(job)
            self._end(job, Finish("cancelled", len(job.prompt.ids), 0, 0))
        for uid, run in list(self.running.items()):
            if run.job.cancelled.is_set():
                reading = [s for s in (*self.generator.waiting, *self.generator.prefilling)
                           if s.uid == uid]
                if reading:  # stopped mid-prompt: how far it got
                    run.prefilled = reading[0].prefilled
                self.generator.remove([uid])
                self._done(uid, "cancelled", "")

    def _admit(self) -> None:
        """Waiting requests join the batch in arrival order while their caches fit."""
        held = sum(run.reserved for run in self.running.values())
        while self.waiting and len(self.running) < self.generator.completion_batch_size:
            job = self.waiting[0]
            siblings = [s for s in job.siblings if s in self.waiting]
            need = self.reserve(len(job.prompt.ids), job.settings.max_tokens) * \
                (1 + len(siblings))
            if held + need > self.kv_budget and self.running:
                return  # it waits for memory (in order: no overtaking)
            self.waiting.popleft()
            for sibling in siblings:  # they share this job's prefill
                self.waiting.remove(sibling)
            try:
                self._insert(job, need, siblings)
                held += need
            except Exception as e:  # a bad image, a prompt the model refuses: this one fails
                log.exception("request failed")
                for one in (job, *siblings):
                    self._end(one, e)

    def _insert(self, job: Job, need: int, siblings: list = ()) -> None:
        settings, prompt = job.settings, job.prompt
        state = self.store.take(self._reuse(job))
        cached = len(state.tokens)
        self._started([job, *siblings], cached)
        todo = prompt.ids[cached:]
        # The tower runs here, for the images whose spans reach past the reused prefix.
        images = prompt.inputs(self.model, cached)
        uid, = self.generator.insert(
            [todo], [settings.max_tokens], [state.cache], samplers=[self._sampler(settings)],
            logits_processors=[list(settings.processors)], seeds=[settings.seed],
            images=[images], histories=[prompt.ids])
        self.running[uid] = _Running(job, state, cached, todo, need // (1 + len(siblings)),
                                     self.tokenizer.detokenizer, StopStrings(settings.stops))
        if siblings:
            forks = self.generator.fork(
                uid, len(siblings), samplers=[self._sampler(s.settings) for s in siblings],
                logits_processors=[list(s.settings.processors) for s in siblings],
                seeds=[s.settings.seed for s in siblings])
            for sibling, child in zip(siblings, forks):
                self.running[child] = _Running(sibling, None, cached, todo,
                                               need // (1 + len(siblings)),
                                               self.tokenizer.detokenizer,
                                               StopStrings(sibling.settings.stops))

    def _prefilled(self, uid: int, cache: list) -> None:
        run = self.running[uid]
        for other in self.running.values():
            if other.todo is run.todo:  # the forks of this prompt: it is in for them too
                other.prefill_seconds = time.perf_counter() - other.tic
        run.prefill_seconds = time.perf_counter() - run.tic
        run.state.tokens.extend(run.todo)
        run.state.images = run.job.prompt.records()
        run.snapshot = run.state.copy()  # the prompt: a thinking-mode next turn resumes here

    def _fail_running(self, error: BaseException) -> None:
        for uid in list(self.running):
            self.generator.remove([uid])
            self._end(self.running.pop(uid).job, error)

    def _step(self) -> None:
        try:
            responses = self.generator.next()
        except Exception as e:  # the whole step failed (no cache changed): so does every request
            log.exception("batch step failed")
            self._fail_running(e)
            return
        for r in responses:
            run = self.running.get(r.uid)
            if run is None:
                continue
            if r.finish_reason == "error":
                log.error("request failed: %s", r.error)
                del self.running[r.uid]
                self._end(run.job, r.error)
                continue
            self._emit(r.uid, run, r)

    def _emit(self, uid: int, run: _Running, r) -> None:
        if r.token < 0:  # finished without a token (nothing left to generate)
            self._done(uid, r.finish_reason, run.stops.pending)
            return
        run.tokens.append(r.token)
        stop_token = r.token in self.tokenizer.eos_token_ids
        if not stop_token:
            run.detokenizer.add_token(r.token)
        if r.finish_reason is not None:
            run.detokenizer.finalize()
        text, stopped = run.stops.feed(run.detokenizer.last_segment)
        run.job.put(Token(text, r.token, *self._logprobs(r, run.job.settings.logprobs)))
        if stopped:
            self.generator.remove([uid])
            self._done(uid, "stop", "")
        elif r.finish_reason is not None:
            self._done(uid, r.finish_reason, run.stops.pending)

    def _done(self, uid: int, reason: str, tail: str) -> None:
        """A sequence left the batch: keep its caches, tell its client."""
        run = self.running.pop(uid)
        prompt, state = run.job.prompt, run.state
        if run.snapshot is not None:  # its prompt is in: keep it (and the reply, if aligned)
            state.tokens.extend(run.tokens)
            try:
                self._keep([run.snapshot, state if align_to_tokens(state) else None])
            except Exception:
                log.exception("prompt cache not kept")
        if run.prefilled is not None:
            log.info("%d prompt tokens (%d cached), cancelled after %d of %d prefilled in "
                     "%.2f s (batch of %d)", len(prompt.ids), run.cached, run.prefilled,
                     len(run.todo), time.perf_counter() - run.tic, len(self.running) + 1)
        else:
            log.info("%d prompt tokens (%d cached, %d prefilled in %.2f s), %d generated, %s "
                     "(batch of %d)%s", len(prompt.ids), run.cached, len(run.todo),
                     run.prefill_seconds, len(run.tokens), reason, len(self.running) + 1,
                     self.expert_note())
        self._end(run.job, Finish(reason, len(prompt.ids), len(run.tokens), run.cached, tail,
                                  stop_sequence=run.stops.matched))

    def _end(self, job: Job, result) -> None:
        if isinstance(result, Finish):
            job.finish = self.last_finish = result
        with self._jobs_lock:
            self._jobs.discard(job)
        job.put(result)
