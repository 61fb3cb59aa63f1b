"""Read-ahead of streamed experts (`expert_store.py`): while one MoE call computes, the experts
the next call is predicted to route to are read into host buffers, so that call finds them
read (or being read) instead of waiting for the SSD.

The prediction: the next MoE module's router applied to this call's input. The residual stream
changes little from one layer to the next, so the next router picks mostly what it will pick
from its own input a layer later. A prediction only decides what is read early: the computed
bits never depend on it. Which module comes next is learned from the order of the calls. A
module whose predictions are mostly unused (a random model, another prompt regime) stops being
read ahead, and is tried again every `PROBE_EVERY` of its calls.
"""

from __future__ import annotations

import numpy as np

PREFETCH_EXPERTS = 16   # a read-ahead of this many experts (host buffers beside the slots)
PREFETCH_FLOOR = 0.3    # a module whose read-ahead is used less than this pauses it
PROBE_EVERY = 16        # a paused module is read ahead again on every this-th call
SMOOTHING = 0.2         # weight of the latest call in a module's running use share


class ReadAhead:
    """Predicted reads for the next MoE call (module docstring).

    Args:
        reader: the store's `FileReader` (its thread pool runs the reads).
        regions: the store's regions (per module, per expert, per part).
        gates: per module, (router, first expert id of the module's table) or None.
        capacity: experts read ahead at most (0: off).
        stats: the store's `ExpertStats`, which count the bytes read ahead and never used.
    """

    def __init__(self, reader, regions: list, gates: list, capacity: int = PREFETCH_EXPERTS,
                 stats=None):
        self.reader, self.regions, self.gates, self.stats = reader, regions, gates, stats
        self.capacity = capacity
        self.next_of: dict = {}     # module -> the module whose call came next last time
        self.last = None
        self.pending: dict = {}     # (module, expert) -> (futures, buffers)
        self.use_share: dict = {}   # module -> running share of its read-ahead that was used
        self.calls: dict = {}       # module -> calls so far
        self.issued_for: dict = {}  # module -> experts read ahead for its coming call
        self.issued = 0             # experts read ahead
        self.used = 0               # of them routed to when their call came

    def begin(self, index: int) -> None:
        """A call of module `index` starts: learn the order, drop other modules' reads."""
        if self.last is not None:
            self.next_of[self.last] = index
        self.last = index
        self.calls[index] = self.calls.get(index, 0) + 1
        for key in [k for k in self.pending if k[0] != index]:
            self._drop(key)

    def take(self, key):
        """The buffers of `key`'s parts if it was read ahead (waiting for its reads; a failed
        read raises here, as a direct read would), else None."""
        entry = self.pending.pop(key, None)
        if entry is None:
            return None
        futures, buffers = entry
        for future in futures:
            future.result()
        self.used += 1
        return buffers

    def predict(self, index: int, x, pool, parts: list) -> None:
        """Start reading what the call after this one (of module `index`, input `x` [T, D])
        will route to and `pool` lacks."""
        following = self.next_of.get(index)
        if not self.capacity or following is None or self.gates[following] is None:
            return
        if self.use_share.get(following, 1.0) < PREFETCH_FLOOR and \
                self.calls.get(following, 0) % PROBE_EVERY:
            return
        router, first = self.gates[following]
        ids = np.array(router.select(x[None])[0]).reshape(-1).astype(np.int64) - first
        count = len(self.regions[following])
        experts, seen = np.unique(ids[(ids >= 0) & (ids < count)], return_counts=True)
        room = self.capacity - len(self.pending)
        for expert in experts[np.argsort(-seen, kind="stable")][:max(room, 0)]:
            key = (following, int(expert))
            if key not in pool.slot_of and key not in self.pending:
                self._submit(key, parts)

    def end(self, index: int) -> None:
        """The call of module `index` is over: what it did not use of its read-ahead is
        dropped, and counted against the module's use share."""
        unused = [k for k in self.pending if k[0] == index]
        issued = self.issued_for.pop(index, 0)
        for key in unused:
            self._drop(key)
        if issued:
            share = 1.0 - len(unused) / issued
            old = self.use_share.get(index, share)
            self.use_share[index] = (1 - SMOOTHING) * old + SMOOTHING * share

    def _submit(self, key, parts: list) -> None:
        buffers = [np.empty(part.nbytes, np.uint8) for part in parts]
        futures = [self.reader.pool.submit(self.reader.read, region, buffer)
                   for region, buffer in zip(self.regions[key[0]][key[1]], buffers)]
        self.pending[key] = (futures, buffers)
        self.issued += 1
        self.issued_for[key[0]] = self.issued_for.get(key[0], 0) + 1

    def _drop(self, key) -> None:
        futures, buffers = self.pending.pop(key)
        for future, buffer in zip(futures, buffers):
            # not started yet: never runs; a started read ends unseen, its bytes wasted
            if not future.cancel() and self.stats is not None:
                self.stats.ahead_unused_bytes += buffer.nbytes
