"""Rank 0's input lines on every rank: an interactive program under `--pipeline` or
`--tensor-parallel` (the chat REPL) reads its terminal or stdin on rank 0 alone, and each line,
or the end of input, reaches the other ranks over the group, so every rank runs the same turn.
One line costs two `all_sum`s (its byte length, then its UTF-8 bytes; the others add zeros).
`exchange` gives every rank every rank's small JSON record (agreeing on a file operation).
`IdleWait` lets the other ranks sleep while rank 0 waits for work (a server between requests).
"""

from __future__ import annotations

import json
import queue
import time
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from .link import Link

END_OF_INPUT = -1  # the length rank 0 shares when its input ended (or Ctrl-C at the prompt)
IDLE = -2  # the length rank 0 shares while it has no work yet (`IdleWait`)


def share_line(link: Link, line: Optional[str]) -> Optional[str]:
    """Rank 0's `line` (None: end of input) on every rank; the others' `line` is ignored."""
    data = line.encode() if link.rank == 0 and line is not None else b""
    length = (END_OF_INPUT if line is None else len(data)) if link.rank == 0 else 0
    return _line_of_length(link, _share_length(link, length), data)


def _share_length(link: Link, length: int) -> int:
    return int(link.all_sum(mx.array([length], mx.int32), "sharing an input line").item())


def _line_of_length(link: Link, total: int, data: bytes) -> Optional[str]:
    """The rest of `share_line` once every rank has the line's length `total`."""
    if total == END_OF_INPUT:
        return None
    if total == 0:
        return ""
    mine = mx.array(np.frombuffer(data, np.uint8)) if link.rank == 0 else \
        mx.zeros((total,), mx.uint8)
    shared = link.all_sum(mine, "sharing an input line")
    return bytes(np.array(shared, copy=False)).decode(errors="replace")


class IdleWait:
    """Rank 0 waiting for work (`wait`) while the other ranks wait for its next line (`line`),
    without keeping them busy: MLX's ring backend waits inside a collective by polling its
    socket, a whole core for as long as the wait lasts (a server left idle for a night). So
    while rank 0 has nothing, the ranks meet once per interval with an empty tick (one
    `all_sum` of `IDLE`), and the others sleep in between, waking a little before rank 0's
    next tick. The interval doubles from `FIRST` to `LONGEST` while nothing comes, so work that
    arrives after a pause waits at most `LONGEST` for the other ranks to wake. Both sides count
    the ticks since the last line that `line` returned and rank 0 sent with `share`, so they
    agree on each interval (work that rank 0 drops unsent, a request cancelled before it
    started, resets nothing)."""

    FIRST, LONGEST = 0.005, 0.1  # seconds
    EARLY = 0.002                # the others wake this much (plus 2 %) before the next tick

    def __init__(self, link: Link):
        self.link = link
        self.ticks = 0  # empty ticks since the last line

    def interval(self) -> float:
        return min(self.LONGEST, self.FIRST * 2 ** self.ticks)

    def wait(self, get: Callable[[float], object]):
        """Rank 0: `get(timeout)` (raising `queue.Empty` or `TimeoutError` when nothing came in
        `timeout` seconds) until it returns something, ticking the other ranks after each
        interval."""
        while True:
            try:
                item = get(self.interval())
            except (queue.Empty, TimeoutError):
                _share_length(self.link, IDLE)
                self.ticks += 1
                continue
            return item

    def share(self, line: Optional[str]) -> Optional[str]:
        """Rank 0: `share_line` of the line the others' `line` returns."""
        self.ticks = 0
        return share_line(self.link, line)

    def line(self) -> Optional[str]:
        """Another rank: rank 0's next `share_line` (None: the end), asleep between ticks."""
        while True:
            interval = self.interval()
            time.sleep(max(0.0, interval * 0.98 - self.EARLY))
            total = _share_length(self.link, 0)
            if total != IDLE:
                self.ticks = 0
                return _line_of_length(self.link, total, b"")
            self.ticks += 1


def shared_readline(link: Link, readline: Callable[[float], Optional[str]]):
    """A readline() returning rank 0's next line on every rank (`readline(timeout)` runs on
    rank 0 only, raising TimeoutError when no line came in `timeout` seconds; Ctrl-C there
    while it waits ends the input on every rank, as Ctrl-D would). While rank 0 waits for its
    user, the other ranks sleep (`IdleWait`)."""
    idle = IdleWait(link)

    def read() -> Optional[str]:
        if link.rank != 0:
            return idle.line()
        try:
            line = idle.wait(readline)
        except KeyboardInterrupt:
            line = None
        return idle.share(line)

    return read


def exchange(link: Link, record: dict, what: str) -> list:
    """Every rank's JSON `record`, in rank order, on every rank: two `all_gather`s (the byte
    lengths, then the records padded to the longest)."""
    data = json.dumps(record).encode()
    lengths = link.all_gather(mx.array([len(data)], mx.int32), what).tolist()
    padded = np.zeros(max(lengths), np.uint8)
    padded[:len(data)] = np.frombuffer(data, np.uint8)
    rows = np.array(link.all_gather(mx.array(padded), what)).reshape(link.size, -1)
    return [json.loads(bytes(row[:n])) for row, n in zip(rows, lengths)]
