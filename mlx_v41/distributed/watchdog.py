"""A rank that is alive but stuck: while a group model prefills or generates, every forward
(and every transfer a pipeline evaluates) counts as progress; none for the group's timeout ends
this rank with one line, instead of leaving it blocked forever inside a collective (MLX's
collectives cannot be interrupted). Idle ranks (a chat at its prompt, a server between
requests) are not watched."""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager


class Watchdog:
    def __init__(self, seconds: float, rank: int):
        self.seconds, self.rank = float(seconds), rank
        self._busy = 0           # nested busy() blocks open now
        self._last = time.monotonic()
        self._what = ""
        self._thread = None
        self._lock = threading.Lock()

    def beat(self) -> None:
        self._last = time.monotonic()

    def beating(self, progress):
        """A prefill `progress` callback that also counts each chunk as progress."""
        def report(done: int, total: int) -> None:
            self.beat()
            if progress is not None:
                progress(done, total)
        return report

    @contextmanager
    def busy(self, what: str):
        """Watch the block: it must make progress (`beat`) at least every `seconds`."""
        with self._lock:
            if not self._busy:
                self._what = what
                self.beat()
            self._busy += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, daemon=True,
                                                name="mlx_v41-watchdog")
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1

    def _watch(self) -> None:
        poll = min(1.0, self.seconds / 4)
        while True:
            time.sleep(poll)
            idle = time.monotonic() - self._last
            if self._busy and idle > self.seconds:
                print(f"mlx_v41: rank {self.rank}: no progress from the group for "
                      f"{self.seconds:g} s while {self._what}: a rank is stuck or the link is "
                      f"down (--distributed-timeout)", file=sys.stderr, flush=True)
                os._exit(1)
