"""Rank 0's input lines on every rank: an interactive program under `--pipeline` or
`--tensor-parallel` (the chat REPL) reads its terminal or stdin on rank 0 alone, and each line,
or the end of input, reaches the other ranks over the group, so every rank runs the same turn.
One line costs two `all_sum`s (its byte length, then its UTF-8 bytes; the others add zeros).
`exchange` gives every rank every rank's small JSON record (agreeing on a file operation)."""

from __future__ import annotations

import json
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from .link import Link

END_OF_INPUT = -1  # the length rank 0 shares when its input ended (or Ctrl-C at the prompt)


def share_line(link: Link, line: Optional[str]) -> Optional[str]:
    """Rank 0's `line` (None: end of input) on every rank; the others' `line` is ignored."""
    data = line.encode() if link.rank == 0 and line is not None else b""
    length = (END_OF_INPUT if line is None else len(data)) if link.rank == 0 else 0
    total = int(link.all_sum(mx.array([length], mx.int32), "sharing an input line").item())
    if total == END_OF_INPUT:
        return None
    if total == 0:
        return ""
    mine = mx.array(np.frombuffer(data, np.uint8)) if link.rank == 0 else \
        mx.zeros((total,), mx.uint8)
    shared = link.all_sum(mine, "sharing an input line")
    return bytes(np.array(shared, copy=False)).decode(errors="replace")


def shared_readline(link: Link, readline: Callable[[], Optional[str]]):
    """A readline() returning rank 0's next line on every rank (`readline` runs on rank 0
    only; Ctrl-C there while it waits ends the input on every rank, as Ctrl-D would)."""
    def read() -> Optional[str]:
        line = None
        if link.rank == 0:
            try:
                line = readline()
            except KeyboardInterrupt:
                line = None
        return share_line(link, line)

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
