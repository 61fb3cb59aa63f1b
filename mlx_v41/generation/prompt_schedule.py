"""The prompt half of a `BatchGenerator` step: admitting waiting prompts and reading them in
pieces (`model.prefill.prefill_pieces`) within the step's budget.

While any sequence decodes, the budget is about one decode step's worth of prompt work
(`PrefillPacer`, Sarathi-Serve's stall-free batching) and the prompt with the least work left
goes first, so a long prompt never stalls the replies already streaming and a short prompt
behind it starts at once; with nothing decoding, `prefill_budget` in `prefill_step_size`
chunks. `decode_prefill_budget=None` keeps the old schedule: `prefill_budget` a step in
chunks taken in turn, the CED halo in one piece.

With a `prompt_thread` (`prompt_thread.PromptThread`) the long prompts are read on a thread of
their own while the batch decodes: a step hands the thread one job (pieces of `THREAD_PIECE`
tokens or one step's budget, whichever is more, for `JOB_STEPS` pieces) when it is free and
takes its result once it is done, so a decode step never waits for a long prompt's work. A
prompt that fits one step's budget is read on the main thread, in the step, as without the
thread, so it never waits behind a long prompt's piece. With nothing decoding the step waits
for its prompts. Each prompt's pieces run on one thread, start to end; the bits are the same.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from functools import partial

import mlx.core as mx

from ..model.prefill import prefill_pieces

JOB_STEPS = 3  # a prompt-thread job while sequences decode: this many pieces
# A piece on the prompt thread while sequences decode (tokens; at least the step's budget):
# long enough that a piece's fixed cost is small (on the CPU after 12K tokens, about 6.8 ms a
# token against 12.8 ms for a piece of the 32-token floor: benchmarks/bench_streams.py), short
# enough that `remove` waits little for the piece in flight.
THREAD_PIECE = 256


class PromptSchedule:
    """`BatchGenerator`'s prompt steps (a base class: it uses the generator's `waiting`,
    `prefilling` and `decoding` queues, `pacer`, `counters`, `prompt_thread`, `_fail` and
    `_start_decoding`)."""

    _collected = None  # a prompt job's result taken early (`_wait_for_prompts`), not yet landed
    _arrivals = None  # long prompts admitted while the job in flight runs: it takes them too
    _stop = None  # set: the job in flight ends after its piece in flight (`_wait_for_prompts`)

    def _admit(self) -> list:
        """Start prefilling waiting prompts while there is room; a prompt the model refuses
        (bad ids, images that do not fit) fails alone."""
        responses = []
        while self.waiting and len(self.prefilling) < self.prefill_batch_size and \
                len(self.prefilling) + len(self.decoding) < self.completion_batch_size:
            seq = self.waiting.popleft()
            seq.on_main = self.prompt_thread is None or self._fits_a_step(seq)
            if not seq.on_main:  # the prompt thread starts its pieces (`_job`)
                mx.eval([c.state for c in seq.cache],  # what the thread reads, computed here
                        [] if seq.images is None else [seq.images.rows])
                self.prefilling.append(seq)
                if self.prompt_thread.busy:
                    self._arrivals.put(seq)
                continue
            try:
                seq.steps = self._pieces(seq)
            except Exception as e:
                responses += self._fail(seq, e)
                continue
            self.prefilling.append(seq)
        return responses

    def _prefill(self) -> list:
        """Pieces of the prefilling prompts within the step's budget (`_budget`)."""
        responses = []
        if self.prompt_thread is not None:
            self._threaded(responses)
        elif self.pacer is not None:
            self._paced(responses, list(self.prefilling))
        elif self.prefilling:
            tic = time.perf_counter()
            self._round_robin(responses)
            self.counters.prompt_time += time.perf_counter() - tic
        return responses

    def _paced(self, responses: list, prompts: list) -> None:
        """`_shortest_first` over `prompts`, its time counted and given to the pacer (halo
        pieces read no new tokens but count)."""
        if not prompts:
            return
        tic = time.perf_counter()
        work = self._shortest_first(responses, prompts)
        seconds = time.perf_counter() - tic
        self.pacer.prefilled(work, seconds)
        self.counters.prompt_time += seconds

    def _budget(self) -> float:
        """The step's prompt work: the pacer's while any sequence decodes, else
        `prefill_budget` (one `prefill_step_size` chunk by default)."""
        self.step_budget = self.pacer.budget() if self.decoding else \
            self.prefill_budget or math.inf
        return self.step_budget

    def _shortest_first(self, responses: list, prompts: list) -> float:
        """Pieces of `prompts` within the step's budget, the prompt with the least work left
        first; a prompt whose next piece does not fit what is left waits (the step's first
        piece always runs). A prompt that starts decoding makes an idle step's budget the
        pacer's."""
        spent = 0.0
        for seq in sorted(prompts, key=_work_left):
            while seq.steps is not None:
                room = self._budget() - spent
                if spent and not self._fits(seq, room):
                    break
                spent += self._piece(seq, room, responses)
        return spent

    def _fits(self, seq, room: float) -> bool:
        """Whether the prompt's next piece is worth starting in `room`: a halo piece whole, a
        chunk of `min_prefill_chunk` rows (or what the prompt has left)."""
        pace = None if seq.steps is None else seq.steps.pace
        if pace is None:  # not started (the prompt thread starts it)
            least = min(len(seq.prompt), self.pacer.min_chunk)
        else:
            least = pace.next if pace.in_halo else min(pace.next, self.pacer.min_chunk)
        return room > 0 and least <= room

    def _round_robin(self, responses: list) -> float:
        """The old schedule: `prefill_step_size` chunks in turn, the halo in one piece, until
        `prefill_budget` prompt tokens."""
        spent, self.step_budget = 0, self.prefill_budget or math.inf
        while self.prefilling and (spent == 0 or spent < self.prefill_budget):
            seq = self.prefilling.popleft()
            self.prefilling.append(seq)  # to the back of the queue
            before = seq.prefilled
            self._piece(seq, math.inf, responses)
            spent += max(seq.prefilled - before, 0)
        return spent

    def _piece(self, seq, allowance: float, responses: list) -> float:
        """Run one piece of the sequence's prompt; its work. The prompt in, it starts
        decoding; a failure (the prompt, or its first sample: a processor) fails it alone."""
        pace, before = seq.steps.pace, seq.prefilled
        try:
            output = self._run_piece(seq, allowance)
            if output is not None:
                seq.steps = None
                self.prefilling.remove(seq)
                self._start_decoding(seq, output.logits)
        except Exception as e:
            seq.steps = None
            responses += self._fail(seq, e)
        self.counters.prompt_tokens += max(seq.prefilled - before, 0)
        return pace.done

    def _fits_a_step(self, seq) -> bool:
        """Whether a prompt is short enough to be read on the main thread in the steps (its
        whole work within one step's budget while sequences decode), so that it does not
        wait behind a long prompt's piece on the prompt thread."""
        return bool(self.decoding) and _work_left(seq) <= self.pacer.budget()

    def _threaded(self, responses: list) -> None:
        """Prompts on the prompt thread: land the job in flight once it is done (waiting for
        it when nothing decodes), hand the thread the next job when it is free, then read the
        short prompts here within the step's budget, beside it; with nothing decoding, wait
        for the job too (a prompt that is in starts decoding in this step). While sequences
        decode a job is `JOB_STEPS` pieces of `THREAD_PIECE` tokens (or the step's budget if
        more), so the thread keeps busy across steps; long prompts admitted meanwhile join
        the job in flight (`_arrivals`)."""
        thread = self.prompt_thread
        self._land(thread.collect(wait=not self.decoding), responses)
        there = [s for s in self.prefilling if not s.on_main]
        if there and not thread.busy:
            piece = self._budget()
            if self.decoding:
                piece = max(piece, min(THREAD_PIECE, self.prefill_step_size or THREAD_PIECE))
            budget = piece * JOB_STEPS if self.decoding else piece
            self._arrivals, self._stop = queue.SimpleQueue(), threading.Event()
            thread.submit(partial(self._job, there, self._arrivals, budget, piece, self._stop))
        self._paced(responses, [s for s in self.prefilling if s.on_main])  # beside the job
        if not self.decoding and thread.busy:
            self._land(thread.collect(wait=True), responses)

    def _job(self, order: list, arrivals, budget: float, piece: float, stop) -> tuple:
        """On the prompt thread: pieces of at most `piece` until `budget` (or `stop` is set),
        the prompt with the least work left first (prompts arriving on `arrivals` included);
        a prompt's pieces start here (`prefill_pieces`, so every array it makes is this
        thread's), and one that is in is evaluated (logits, taps, cache) for the main thread
        and ends the job.
        ([(sequence, prefilled before, output or None, error or None)] per piece, the work
        done)."""
        ran, spent, ended = [], 0.0, set()
        while True:
            while not arrivals.empty():
                order.append(arrivals.get())
            live = [s for s in order if id(s) not in ended]
            if not live or stop.is_set():
                break
            seq = min(live, key=_work_left)
            if spent and not self._fits(seq, budget - spent):
                break
            before, output, error = seq.prefilled, None, None
            try:
                if seq.steps is None:
                    seq.steps = self._pieces(seq)
                pace = seq.steps.pace
                output = seq.steps.run(min(budget - spent, piece))
                spent += pace.done
                if output is not None:
                    mx.eval(output.logits, list(output.taps.values()),
                            [c.state for c in seq.cache])
            except Exception as e:
                error = e
            ran.append((seq, before, output, error))
            if output is not None:  # its first token waits for the job's end: end it now
                break
            if error is not None:
                ended.add(id(seq))
        return ran, spent

    def _land(self, collected, responses: list) -> None:
        """Take a prompt job's result on the main thread: count its work, start the prompts
        that are in, fail those that failed (a sequence removed meanwhile is left out)."""
        early, self._collected = self._collected, None
        for done in (early, collected):
            if done is None:
                continue
            (ran, work), seconds = done
            self.pacer.prefilled(work, seconds)
            self.counters.prompt_time += seconds
            for seq, before, output, error in ran:
                self.counters.prompt_tokens += max(seq.prefilled - before, 0)
                if seq not in self.prefilling:
                    continue
                if error is not None:
                    seq.steps = None
                    responses += self._fail(seq, error)
                elif output is not None:
                    seq.steps = None
                    self.prefilling.remove(seq)
                    self._start_decoding(seq, output.logits)

    def _wait_for_prompts(self) -> None:
        """Let the prompt job in flight end (its result lands at the next step), so that no
        prompt is being read while the caller changes the queues."""
        if self.prompt_thread is not None and self.prompt_thread.busy:
            self._stop.set()  # the job ends after its piece in flight
            self._collected = self.prompt_thread.collect(wait=True)

    def _pieces(self, seq):
        return prefill_pieces(self.model, seq.prompt, seq.cache, step_size=self.prefill_step_size,
                              images=seq.images, progress=seq.progress)

    def _run_piece(self, seq, allowance: float):
        """`Pieces.run`; interrupted (Ctrl-C), the prompt's cache is back as before the
        prompt, so it waits at the front of the queue to be read again from its start."""
        try:
            return seq.steps.run(allowance)
        except Exception:
            raise
        except BaseException:
            seq.steps, seq.prefilled = None, 0
            self.prefilling.remove(seq)
            self.waiting.appendleft(seq)
            raise


def _work_left(seq) -> float:
    """A prefilling prompt's work left (prompt tokens; one not started: its length)."""
    return len(seq.prompt) if seq.steps is None else seq.steps.pace.left
