"""A thread of its own that reads prompt pieces while the batch decodes (`BatchGenerator`'s
`prefill_thread=True`).

The decode step is mostly host work and waits (building the graph, the few-token evaluations
inside a layer), a prompt piece mostly arithmetic; run one after the other, a reply's token gap
is the sum of both. On a thread of its own, with an MLX stream of its own (MLX streams belong
to the thread that made them), the piece's arithmetic runs while the main thread builds and
runs the decode step, and the decode step never waits for the piece to end. It is slowed all
the same: MLX limits the tasks in flight over all streams together, so while a piece is being
evaluated each dispatch of the decode step waits for one of the piece's tasks
(benchmarks/bench_streams.py).

What crosses between the threads is evaluated first: a prompt's cache before its first piece
(`PromptSchedule._admit`), and its logits, taps and cache after its last (the job's), so
neither thread's graph reads an array the other has not computed. A generator has one job in
flight at a time; it takes the result when the job is done (`collect`). The thread is one per
process and device, started on first use and kept until the process ends.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Optional

import mlx.core as mx

from ..kernels.context import short_evaluations, using

THREAD_NAME = "mlx_v41-prompts"


class PromptThread:
    """One job at a time on the process's prompt thread (`_worker`), with `kernels` active.
    `submit(job)` starts it; `collect(wait)` gives `(result, seconds)` once it has ended (an
    exception the job raised is raised there), None while it runs or when none is in flight;
    `close()` waits for the job in flight and takes no more."""

    def __init__(self, kernels=None):
        self.kernels = kernels
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self.busy = self.closed = False
        self._worker = _worker(mx.default_device())

    def submit(self, job: Callable[[], object]) -> None:
        if self.closed:
            raise RuntimeError("the prompt thread has been closed")
        if self.busy:
            raise RuntimeError("a prompt job is already in flight")
        self.busy = True
        self._worker.put((job, self.kernels, self._results))

    def collect(self, wait: bool) -> Optional[tuple]:
        if not self.busy:
            return None
        try:
            result, error, seconds = self._results.get(block=wait)
        except queue.Empty:
            return None
        self.busy = False
        if error is not None:
            raise error
        return result, seconds

    def close(self) -> None:
        """Wait for the job in flight (its result is dropped); take no more jobs."""
        if self.busy:
            self._results.get()
            self.busy = False
        self.closed = True


_WORKERS: dict = {}  # device -> the job queue of its prompt thread
_LOCK = threading.Lock()


def _worker(device) -> queue.SimpleQueue:
    """The job queue of the process's prompt thread for `device`, started on first use. The
    thread lives as long as the process: MLX can abort at exit over the stream of a thread
    that has ended, and one idle thread costs nothing."""
    with _LOCK:
        key = str(device)
        if key not in _WORKERS:
            jobs: queue.SimpleQueue = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(jobs, device), name=THREAD_NAME,
                             daemon=True).start()
            _WORKERS[key] = jobs
        return _WORKERS[key]


def _serve(jobs: queue.SimpleQueue, device) -> None:
    with mx.stream(mx.new_stream(device)):
        while True:
            job, kernels, results = jobs.get()
            tic = time.perf_counter()
            try:
                with using(kernels), short_evaluations():
                    result = job()
                results.put((result, None, time.perf_counter() - tic))
            except BaseException as e:  # noqa: BLE001 - handed to the submitting thread
                results.put((None, e, time.perf_counter() - tic))


def check_prefill_thread(model, decode_prefill_budget) -> None:
    """A ValueError naming why a prompt thread cannot serve this generator: it needs the paced
    schedule, one process (ranks must run the same steps in the same order) and resident
    experts (the streamed experts' cache is one, read by every forward)."""
    if decode_prefill_budget is None:
        raise ValueError("prefill_thread needs the paced schedule: decode_prefill_budget "
                         "'auto' or a number, not None")
    if getattr(model, "group", None) is not None:
        raise ValueError("prefill_thread needs a model in one process, not split over ranks")
    if getattr(model, "expert_store", None) is not None:
        raise ValueError("prefill_thread needs resident experts; this model streams them "
                         "from SSD")
