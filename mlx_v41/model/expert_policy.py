"""Eviction policies of the streamed-expert cache (`expert_store.py`): which resident expert
gives up its slot when a routed expert is missing. Keys are (module index, expert id); a
policy only orders keys, the store owns the slots.

* `LRU`: the least recently routed expert goes first.
* `LFRU` (default): a decayed use count per expert, ties broken by recency. Routers reuse a
  few experts of each layer far more than the rest; a count that fades by half every
  `half_life` steps keeps those hot experts through a burst of one-off experts, which LRU
  evicts them for. `benchmarks/bench_expert_policy.py` measures both (and the offline
  optimum) on random and skewed routing traces.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from typing import Hashable, Iterable

POLICIES = ("lfru", "lru")
DEFAULT_POLICY = "lfru"
DEFAULT_HALF_LIFE = 64.0  # steps (MoE calls of one layer) for a use to count half


class LRU:
    """Least recently used."""

    def __init__(self):
        self.order: OrderedDict = OrderedDict()  # key -> None, least recent first

    def use(self, keys: Iterable[Hashable]) -> None:
        """A step routed to `keys` (resident or just loaded)."""
        for key in keys:
            self.order[key] = None
            self.order.move_to_end(key)

    def forget(self, key: Hashable) -> None:
        self.order.pop(key, None)

    def victims(self, count: int, keep: set) -> list:
        """`count` resident keys to evict, none of `keep` (the step's own experts)."""
        out = []
        for key in self.order:
            if len(out) == count:
                break
            if key not in keep:
                out.append(key)
        return out


class LFRU:
    """Decayed frequency with recency tie-break: each use adds 1 to a key's count, and every
    count halves over `half_life` steps of each module (a step: one MoE call of one module).
    Counts are kept as logs of the undecayed sum of exp(rate * clock) increments, so the
    order of unused keys never changes and a heap with lazy deletion finds the victims."""

    def __init__(self, modules: int = 1, half_life: float = DEFAULT_HALF_LIFE):
        self.rate = math.log(2.0) / (half_life * max(modules, 1))
        self.clock = 0
        self.score: dict = {}     # key -> (log count, clock of its last use)
        self.heap: list = []      # (log count, clock, key), stale entries skipped

    def use(self, keys: Iterable[Hashable]) -> None:
        self.clock += 1
        now = self.rate * self.clock
        for key in keys:
            old = self.score.get(key, (-math.inf, 0))[0]
            high, low = max(old, now), min(old, now)
            entry = (high + math.log1p(math.exp(low - high)), self.clock)
            self.score[key] = entry
            heapq.heappush(self.heap, (*entry, key))
        if len(self.heap) > 4 * len(self.score) + 1024:  # drop the stale entries
            self.heap = [(*v, k) for k, v in self.score.items()]
            heapq.heapify(self.heap)

    def forget(self, key: Hashable) -> None:
        self.score.pop(key, None)

    def victims(self, count: int, keep: set) -> list:
        out, popped = [], []
        while self.heap and len(out) < count:
            entry = heapq.heappop(self.heap)
            *value, key = entry
            if self.score.get(key) != tuple(value):
                continue  # stale: used again since, or forgotten
            popped.append(entry)  # still resident until the store forgets it
            if key not in keep:
                out.append(key)
        for entry in popped:
            heapq.heappush(self.heap, entry)
        return out


def make_policy(name: str, modules: int = 1):
    """A policy by name (`POLICIES`) for a cache shared by `modules` MoE modules."""
    if name == "lru":
        return LRU()
    if name == "lfru":
        return LFRU(modules)
    raise ValueError(f"expert cache policy must be one of {POLICIES}, got {name!r}")
