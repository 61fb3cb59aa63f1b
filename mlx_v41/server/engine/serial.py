"""The engine: one model, one worker thread that runs requests in arrival order, the prompt
caches it reuses, and the events it streams back to the asyncio side (one queue per request).
A request that is cancelled (its client went away) stops at its next token.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx

from ...generation.api import prefill, stream_decode, wired_limit
from ...generation.group import ONE_PROCESS, ProcessGroup
from ...generation.sequence import BatchStats
from ...generation.speculative import Sampling
from ...model.vision.prompt import ImagePrompt, prepare_prompt
from .prompt_store import PromptCacheStore, align_to_tokens
from ...chat.completion import held_suffix

log = logging.getLogger("mlx_v41.server")


class _Cancelled(Exception):
    """A request's client left (or the server stopped it) while its prompt was being read,
    after `args[0]` of its tokens."""


class EngineBusy(RuntimeError):
    """Too many requests in flight (HTTP 429)."""


class EngineClosed(RuntimeError):
    """The engine is shutting down (HTTP 503)."""


@dataclass
class Settings:
    """How one request decodes. `logprobs`: None, or the alternatives to report per token."""

    max_tokens: int
    temp: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    top_k: int = 0
    seed: Optional[int] = None
    stops: list = field(default_factory=list)
    logprobs: Optional[int] = None
    processors: list = field(default_factory=list)
    processor_fields: dict = field(default_factory=dict)  # what `processors` were made of


@dataclass
class Token:
    """A generated token and the text it releases (stop-string look-ahead may delay text)."""

    text: str
    token: int
    logprob: Optional[float] = None
    top: Optional[list] = None  # [(token id, logprob)], best first
    index: int = 0  # the choice (OpenAI's `n`)


@dataclass
class Finish:
    """The end of a request: why, the token counts, and text held back until now."""

    reason: str  # "stop", "length" or "cancelled"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    text: str = ""
    index: int = 0  # the choice (OpenAI's `n`)
    stop_sequence: Optional[str] = None  # the stop string that ended it, if one did


class StopStrings:
    """Finds the first stop string in streamed text; text that may begin one is held back."""

    def __init__(self, stops):
        self.stops, self.pending = [s for s in stops if s], ""
        self.matched: Optional[str] = None  # the stop string found (first in the text)

    def feed(self, text: str) -> tuple:
        """(text safe to release, whether a stop string was reached)."""
        self.pending += text
        hits = [(i, s) for i, s in ((self.pending.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda hit: hit[0])
            out, self.pending = self.pending[:at], ""
            return out, True
        keep = held_suffix(self.pending, self.stops)
        out, self.pending = self.pending[:len(self.pending) - keep], \
            self.pending[len(self.pending) - keep:]
        return out, False


class Job:
    """One request: its prompt (an `ImagePrompt`: ids with image spans) and settings, its event
    queue (filled from the worker thread) and its cancel flag; the engine's observer, if any,
    sees each event as it is put."""

    def __init__(self, prompt: ImagePrompt, settings: Settings,
                 loop: asyncio.AbstractEventLoop, observer=None):
        self.prompt, self.settings, self.loop = prompt, settings, loop
        self.observer, self.submitted = observer, time.perf_counter()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.finish: Optional[Finish] = None
        self.reuse = None  # across ranks: rank 0's choice of a cached prefix, shared
        self.index = 0  # the choice it answers (OpenAI's `n`)
        self.siblings: list = []  # the other choices' jobs, which share this one's prefill
        self.error: Optional[BaseException] = None  # why the server ended it (`abort`)
        self.has_reply = False  # a token went out

    def put(self, item) -> None:
        if isinstance(item, Finish) and item.reason == "cancelled" and self.error is not None:
            item = self.error  # ended by the server, not by its client: the client hears why
        self.has_reply = self.has_reply or isinstance(item, Token)
        if isinstance(item, (Token, Finish)):
            item.index = self.index
        if self.observer is not None:
            self.observer.event(self, item)
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone: nobody listens any more
            self.cancelled.set()

    def cancel(self) -> None:
        self.cancelled.set()

    def abort(self, error: BaseException) -> None:
        """Cancel it for the server's sake: it ends (at its next chunk or token) with `error`
        instead of a "cancelled" finish. A later abort before it ends keeps the first reason
        (a request the drain ended stays "not started" if the grace runs out meanwhile)."""
        if self.error is None:
            self.error = error
        self.cancelled.set()

    async def events(self):
        """`Token`s then one `Finish`; an exception from the worker is raised here."""
        while True:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if isinstance(item, Finish):
                return


class Engine:
    """Owns the model, its prompt-cache store and the request queue.

    Args:
        draft: None or "dspark" (the model loaded with dspark=True); with `num_draft_tokens`
            and `draft_confidence` as in `stream_generate`.
        max_concurrent: requests queued or running at most; more are refused (EngineBusy).
        group: the processes running the model (`generation.group`).
    """

    def __init__(self, model, tokenizer, store: PromptCacheStore, *, prefill_step_size=None,
                 draft: Optional[str] = None, num_draft_tokens: int = 5,
                 draft_confidence: Optional[float] = None, max_concurrent: int = 32,
                 group: ProcessGroup = ONE_PROCESS):
        self.model, self.tokenizer, self.store = model, tokenizer, store
        self.group = group
        self.prefill_step_size, self.max_concurrent = prefill_step_size, max_concurrent
        self.draft = {} if draft is None else {"draft": draft, "num_draft_tokens":
                                               num_draft_tokens,
                                               "draft_confidence": draft_confidence}
        self.lock = threading.Lock()  # held while the model runs a request
        self._queue: queue.Queue = queue.Queue()
        self._jobs: set = set()
        self._jobs_lock = threading.Lock()
        self._closing = False
        self._ready = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.last_finish: Optional[Finish] = None
        self.label = ""  # opens the per-request log line ("rank R: " across ranks)
        # told of each request's start and events (`server.metrics.ServerMetrics`), or None
        self.observer = None
        self.counters = BatchStats()  # the DSpark drafts proposed and accepted, so far

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the worker; returns once the persisted prompt caches are loaded."""
        self._thread = threading.Thread(target=self._work, name="mlx_v41-engine", daemon=True)
        self._thread.start()
        self._ready.wait()

    def close(self) -> None:
        """End what is queued or running (EngineClosed), write new prompt caches, stop the
        worker."""
        self.end_all("the server shut down before the reply finished")
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join()

    def drain(self) -> None:
        """Stop admitting (`submit` raises EngineClosed) and end the requests whose reply has
        not begun, queued or reading their prompt (at its next chunk), with EngineClosed;
        the replies under way go on (`in_flight` counts what is left)."""
        self._abort(lambda job: not job.has_reply,
                    "the server is shutting down: the request was not started")

    def end_all(self, message: str) -> None:
        """Stop admitting and end every request (at its next chunk or token) with
        EngineClosed(`message`)."""
        self._abort(lambda job: True, message)

    def _abort(self, is_chosen, message: str) -> None:
        with self._jobs_lock:
            self._closing = True
            for job in self._jobs:
                if is_chosen(job):
                    job.abort(EngineClosed(message))

    @property
    def in_flight(self) -> int:
        return len(self._jobs)

    def submit(self, prompt, settings: Settings) -> Job:
        """Queue a request; `prompt` is token ids or an `ImagePrompt` (images' spans expanded,
        their tower rows computed by the worker)."""
        if not isinstance(prompt, ImagePrompt):
            prompt = prepare_prompt(self.model, list(prompt))
        job = Job(prompt, settings, asyncio.get_running_loop(), self.observer)
        with self._jobs_lock:
            if self._closing:
                raise EngineClosed("the server is shutting down")
            if len(self._jobs) >= self.max_concurrent:
                raise EngineBusy(f"the server is busy: {len(self._jobs)} requests in flight "
                                 f"(--max-concurrent-requests {self.max_concurrent}); retry")
            self._jobs.add(job)
        self._queue.put(job)
        return job

    def submit_many(self, prompt, settings: list) -> list:
        """One job per choice of a request with `n` = len(settings) > 1 (here: each runs its
        own request; the prompt cache makes the later prefills short). All or none queued."""
        jobs = []
        try:
            for s in settings:
                jobs.append(self.submit(prompt, s))
        except BaseException:
            for job in jobs:
                job.cancel()
            raise
        for i, job in enumerate(jobs):
            job.index = i
        return jobs

    # ------------------------------------------------------------------ worker thread

    def _work(self) -> None:
        self._load_store()
        while (job := self._next_job()) is not None:
            self._serve(job)
        self._end_worker()

    def _next_job(self) -> Optional[Job]:
        """The next queued job (None: the engine closes), waiting as long as it takes."""
        return self._queue.get()

    def _load_store(self) -> None:
        """The worker's first step: load the persisted prompt caches, then let `start`
        return."""
        try:
            loaded = self.store.load_folder()
            if loaded:
                log.info("loaded %d prompt caches from %s", loaded, self.store.folder)
        except Exception:  # e.g. an unreadable folder: serve without the persisted caches
            log.exception("prompt caches not loaded from %s", self.store.folder)
        finally:
            self._ready.set()

    def _end_worker(self) -> None:
        """The worker's last step: tell the others (`_stopped`), write new cache entries, and
        end this thread's MLX streams with it (MLX aborts at exit on streams of a thread that
        is gone)."""
        self._stopped()
        self._flush()
        mx.synchronize()
        mx.clear_streams()

    def _stopped(self) -> None:
        """The worker's last call before it ends (a group engine tells the other ranks)."""

    def _is_cancelled(self, job: Job) -> bool:
        """Checked after every token (a group engine shares rank 0's answer)."""
        return job.cancelled.is_set()

    def _prefill_check(self, job: Job):
        """Called after each prefill chunk: stops a prompt whose client left (one process;
        across ranks the prompt runs to its end, its cancel is seen at the first token)."""
        if self.group is not ONE_PROCESS:
            return None

        def check(done: int, total: int) -> None:
            if job.cancelled.is_set():
                raise _Cancelled(done)
        return check

    def _started(self, jobs: list, cached: int) -> None:
        """`jobs` (the choices of one prompt) begin their prefill, `cached` tokens reused."""
        if self.observer is not None:
            self.observer.started(jobs, cached)

    def _reuse(self, job: Job):
        """The store's choice of a cached prefix for the job (`PromptCacheStore.choose`)."""
        return self.store.choose(job.prompt.ids, job.prompt.records())

    def _keep(self, states: list) -> None:
        """Offer the request's caches (None: not to be kept) to the store, in order."""
        for state in states:
            if state is not None:
                self.store.insert(state)

    def _serve(self, job: Job) -> None:
        try:
            if job.cancelled.is_set():
                result = Finish("cancelled", len(job.prompt.ids), 0, 0)
            else:
                with self.lock, wired_limit(self.model):
                    result = self._run(job)
            job.finish = self.last_finish = result
        except Exception as e:  # the request fails; the server and its caches stay as they were
            log.exception("request failed")
            result = e
        finally:
            with self._jobs_lock:  # before the reply, so its client may send the next at once
                self._jobs.discard(job)
        job.put(result)
        self._flush()  # after the reply: a slow disk delays the next request only

    def _flush(self) -> None:
        try:
            self.store.flush()
        except Exception:  # the worker must survive whatever the disk does
            log.exception("prompt caches not written to %s", self.store.folder)

    def _run(self, job: Job) -> Finish:
        settings = job.settings
        if settings.seed is not None:
            mx.random.seed(settings.seed)
        prompt, records = job.prompt, job.prompt.records()
        state = self.store.take(self._reuse(job))
        cached = len(state.tokens)
        self._started([job], cached)
        todo = prompt.ids[cached:]
        tic = time.perf_counter()
        # The tower runs here, for the images whose spans reach past the reused prefix.
        try:
            logits = prefill(self.model, todo, state.cache, self.prefill_step_size,
                             self._prefill_check(job),
                             images=prompt.inputs(self.model, cached), group=self.group)
        except _Cancelled as stop:  # mid-prompt: the cache is as it was, nothing kept
            log.info("%s%d prompt tokens (%d cached), cancelled after %d of %d prefilled in "
                     "%.2f s", self.label, len(prompt.ids), cached, stop.args[0], len(todo),
                     time.perf_counter() - tic)
            return Finish("cancelled", len(prompt.ids), 0, cached)
        seconds = time.perf_counter() - tic
        state.tokens.extend(todo)
        state.images = records
        snapshot = state.copy()  # the prompt: a thinking-mode next turn resumes here
        tokens, reason, tail, matched = self._decode(job, state, logits, len(todo), seconds)
        state.tokens.extend(tokens)
        # Only now: a failed request leaves the store as it was.
        self._keep([snapshot, state if align_to_tokens(state) else None])
        log.info("%s%d prompt tokens (%d cached, %d prefilled in %.2f s, %d images), %d "
                 "generated, %s%s", self.label, len(prompt.ids), cached, len(todo), seconds,
                 len(records), len(tokens), reason, self.expert_note())
        return Finish(reason, len(prompt.ids), len(tokens), cached, tail, stop_sequence=matched)

    def expert_note(self) -> str:
        """The expert cache's counters since the server started (streamed experts only)."""
        store = getattr(self.model, "expert_store", None)
        return "" if store is None else f"; experts since start: {store.stats.summary()}"

    def _decode(self, job: Job, state, logits, prefilled: int, seconds: float) -> tuple:
        """Stream the reply's tokens to the job; (tokens, finish reason, held text, the stop
        string that ended it or None)."""
        settings, stops = job.settings, StopStrings(job.settings.stops)
        tokens, reason, drafts = [], "length", None
        responses = stream_decode(
            self.model, self.tokenizer, logits, state.cache, prompt_tokens=prefilled,
            prompt_seconds=seconds, max_tokens=settings.max_tokens, sampler=self._sampler(settings),
            logits_processors=settings.processors or None, history=job.prompt.ids,
            group=self.group, **self.draft)
        try:
            for response in responses:
                tokens.append(response.token)
                drafts = response.draft_stats  # the stream's, so far
                text, is_stopped = stops.feed(response.text)
                job.put(Token(text, response.token, *self._logprobs(response, settings.logprobs)))
                reason = response.finish_reason or reason
                if is_stopped:
                    return tokens, "stop", "", stops.matched
                if self._is_cancelled(job):
                    return tokens, "cancelled", "", None
        finally:
            responses.close()
            if drafts is not None:
                self.counters.drafts_proposed += drafts.proposed
                self.counters.drafts_accepted += drafts.accepted
        return tokens, reason, stops.pending, None

    def _sampler(self, settings: Settings):
        top_k = max(settings.top_k, 0)
        if self.draft:  # speculative sampling is exact only with known settings
            return Sampling(settings.temp, settings.top_p, settings.min_p, top_k)
        from mlx_lm.sample_utils import make_sampler

        return make_sampler(settings.temp, settings.top_p, settings.min_p, top_k=top_k)

    def _logprobs(self, response, count: Optional[int]) -> tuple:
        """(logprob of the token, [(id, logprob)] of the `count` best), or Nones."""
        if count is None or response.token in self.tokenizer.eos_token_ids:
            return None, None
        row = response.logprobs
        chosen = row[response.token].item()
        if count == 0:
            return chosen, []
        best = mx.argpartition(-row, count - 1)[:count]
        values = row[best]
        order = mx.argsort(-values)
        return chosen, list(zip(best[order].tolist(), values[order].tolist()))
