"""Eviction policies of the streamed-expert cache (`expert_store.py`): which resident expert
gives up its slot when a routed expert is missing. Keys are (module index, expert id); a
policy only orders keys, the store owns the slots.

* `LRU`: the least recently routed expert goes first.
* `LFRU` (default): a decayed use count per expert, the lowest first, with the experts of the
  last token guarded. Routers reuse a few experts of each layer far more than the rest; a
  count that halves every `half_life` steps keeps those hot experts through one-off experts
  that LRU evicts them for, and fades fast enough to follow a change of topic.
  `benchmarks/bench_expert_policy.py` measures both (and the offline optimum) on random,
  skewed, topic-changing and batched routing traces.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from typing import Hashable, Iterable

POLICIES = ("lfru", "lru")
DEFAULT_POLICY = "lfru"
DEFAULT_HALF_LIFE = 16.0  # steps (MoE calls of one layer) for a use to count half


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
    """Decayed frequency with a recency guard: each use adds 1 to a key's count, and every
    count halves over `half_life` steps of each module (a step: one MoE call of one module).
    The keys used in the last `guard` steps of each module (one token by default) are not
    named while any other key is left: a just-loaded expert holds a count of 1, below every
    hot expert's, and would otherwise be evicted before the next token could reuse it.

    Counts are kept as logs of undecayed sums of exp(rate * clock) increments, so the order of
    unused keys never changes: a heap with lazy deletion holds the keys past the guard, a
    window ordered by last use the others."""

    def __init__(self, modules: int = 1, half_life: float = DEFAULT_HALF_LIFE,
                 guard: float = 1.0):
        self.rate = math.log(2.0) / (half_life * max(modules, 1))
        self.guard = guard * max(modules, 1)
        self.clock = 0
        self.score: dict = {}             # key -> (log count, clock of its last use)
        self.heap: list = []              # (log count, clock, key) of keys past the guard
        self.recent: OrderedDict = OrderedDict()  # key -> None, least recent first

    def use(self, keys: Iterable[Hashable]) -> None:
        self.clock += 1
        now = self.rate * self.clock
        for key in keys:
            old = self.score.get(key, (-math.inf, 0))[0]
            high, low = max(old, now), min(old, now)
            self.score[key] = (high + math.log1p(math.exp(low - high)), self.clock)
            self.recent[key] = None
            self.recent.move_to_end(key)
        while self.recent:  # keys whose last use left the guard join the heap
            key = next(iter(self.recent))
            if self.clock - self.score[key][1] < self.guard:
                break
            del self.recent[key]
            heapq.heappush(self.heap, (*self.score[key], key))
        if len(self.heap) > 4 * len(self.score) + 1024:  # drop the stale entries
            self.heap = [(*v, k) for k, v in self.score.items() if k not in self.recent]
            heapq.heapify(self.heap)

    def forget(self, key: Hashable) -> None:
        self.score.pop(key, None)
        self.recent.pop(key, None)

    def victims(self, count: int, keep: set) -> list:
        out, popped = [], []
        while self.heap and len(out) < count:
            entry = heapq.heappop(self.heap)
            *value, key = entry
            if self.score.get(key) != tuple(value) or key in self.recent:
                continue  # stale: used again since, or forgotten
            popped.append(entry)  # still resident until the store forgets it
            if key not in keep:
                out.append(key)
        for entry in popped:
            heapq.heappush(self.heap, entry)
        if len(out) < count:  # only guarded keys are left: lowest count first
            guarded = sorted((k for k in self.recent if k not in keep),
                             key=lambda k: self.score[k])
            out += guarded[:count - len(out)]
        return out


def make_policy(name: str, modules: int = 1):
    """A policy by name (`POLICIES`) for a cache shared by `modules` MoE modules."""
    if name == "lru":
        return LRU()
    if name == "lfru":
        return LFRU(modules)
    raise ValueError(f"expert cache policy must be one of {POLICIES}, got {name!r}")
