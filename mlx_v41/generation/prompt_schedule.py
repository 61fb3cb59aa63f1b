"""The prompt half of a `BatchGenerator` step: admitting waiting prompts and reading them in
pieces (`model.prefill.prefill_pieces`) within the step's budget.

While any sequence decodes, the budget is about one decode step's worth of prompt work
(`PrefillPacer`, Sarathi-Serve's stall-free batching) and the prompt with the least work left
goes first, so a long prompt never stalls the replies already streaming and a short prompt
behind it starts at once; with nothing decoding, `prefill_budget` in `prefill_step_size`
chunks. `decode_prefill_budget=None` keeps the old schedule: `prefill_budget` a step in
chunks taken in turn, the CED halo in one piece.
"""

from __future__ import annotations

import math
import time

from ..model.prefill import prefill_pieces


class PromptSchedule:
    """`BatchGenerator`'s prompt steps (a base class: it uses the generator's `waiting`,
    `prefilling` and `decoding` queues, `pacer`, `counters`, `_fail` and `_start_decoding`)."""

    def _admit(self) -> list:
        """Start prefilling waiting prompts while there is room; a prompt the model refuses
        (bad ids, images that do not fit) fails alone."""
        responses = []
        while self.waiting and len(self.prefilling) < self.prefill_batch_size and \
                len(self.prefilling) + len(self.decoding) < self.completion_batch_size:
            seq = self.waiting.popleft()
            try:
                seq.steps = prefill_pieces(self.model, seq.prompt, seq.cache,
                                           step_size=self.prefill_step_size, images=seq.images,
                                           progress=seq.progress)
            except Exception as e:
                responses += self._fail(seq, e)
                continue
            self.prefilling.append(seq)
        return responses

    def _prefill(self) -> list:
        """Pieces of the prefilling prompts within the step's budget (`_budget`)."""
        responses, tic, reading = [], time.perf_counter(), bool(self.prefilling)
        if self.pacer is None:
            self._round_robin(responses)
        else:
            work = self._shortest_first(responses)
            self.pacer.prefilled(work, time.perf_counter() - tic)
        if reading:  # a piece ran (halo pieces read no new tokens but count)
            self.counters.prompt_time += time.perf_counter() - tic
        return responses

    def _budget(self) -> float:
        """The step's prompt work: the pacer's while any sequence decodes, else
        `prefill_budget` (one `prefill_step_size` chunk by default)."""
        self.step_budget = self.pacer.budget() if self.decoding else \
            self.prefill_budget or math.inf
        return self.step_budget

    def _shortest_first(self, responses: list) -> float:
        """Pieces within the step's budget, the prompt with the least work left first; a
        prompt whose next piece does not fit what is left waits (the step's first piece
        always runs). A prompt that starts decoding makes an idle step's budget the pacer's."""
        spent = 0.0
        for seq in sorted(self.prefilling, key=lambda s: s.steps.pace.left):
            while seq.steps is not None:
                room = self._budget() - spent
                if spent and not self._fits(seq, room):
                    break
                spent += self._piece(seq, room, responses)
        return spent

    def _fits(self, seq, room: float) -> bool:
        """Whether the prompt's next piece is worth starting in `room`: a halo piece whole, a
        chunk of `min_prefill_chunk` rows (or what the prompt has left)."""
        pace = seq.steps.pace
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
