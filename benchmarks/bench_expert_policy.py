"""Hit rates of the streamed-expert cache's eviction policies on synthetic routing traces.

No model: each trace is decode routing over the published 43 MoE modules (40 layers of 384
experts, top-6; 3 drafter layers of 128, top-3), one call per module per token in layer order,
all modules sharing one pool of slots (one expert layout). The calls go through the store's own
admission, `ExpertStore._admit`, on a store without arrays whose `_load` only hands out slots;
so victims are asked for exactly as in a real run (only for the shortfall after the free slots,
with the call's experts kept, before `use`). Policies: `LRU`, `LFRU` (per --half-life), the
offline optimum (Belady: evict the key used again farthest ahead; an upper bound for any policy),
"unbounded", the share of routed experts seen before (the ceiling with every slot). LFRU runs
per --half-life and --guard (the tokens whose keys are spared while others are left; 0: none;
the default is the shipped policy: half-life 16, guard 1).

Traces (seeded): random (uniform top-k, the worst case); skewed (per layer a Zipf popularity
over a random permutation of the experts, and each routed expert repeats one of the previous
token's at that layer with probability --reuse); phase (skewed, new permutations every --phase
tokens); batch4 (4 skewed sequences sharing the layers' popularity, the call's keys their union).

    python benchmarks/bench_expert_policy.py [--tokens 400 --seed 0 --half-life 16 64
                                              --guard 0 1 --budgets 0.1 0.25 0.5]
"""

from __future__ import annotations

import argparse
import heapq
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout too
from mlx_v41.model.expert_policy import DEFAULT_HALF_LIFE, LFRU, LRU  # noqa: E402
from mlx_v41.model.expert_store import ExpertStats, ExpertStore  # noqa: E402

MODULES = [(384, 6)] * 40 + [(128, 3)] * 3  # (experts, routed per token) in layer order
BATCH = 4  # sequences of the batched trace


# ------------------------------------------------------------------------------ traces

def zipf_logits(rng, exponent: float) -> list:
    """Per module, log popularity of each expert: -exponent * log(rank + 1), ranks permuted."""
    return [-exponent * np.log1p(rng.permutation(n)) for n, _ in MODULES]


def route(rng, logits: np.ndarray, k: int, previous: np.ndarray | None, reuse: float):
    """One token's k experts at one module: Binomial(k, reuse) of them repeat the previous
    token's, the rest drawn without replacement by popularity (Gumbel top-k)."""
    repeats = 0 if previous is None else rng.binomial(k, reuse)
    kept = rng.choice(previous, repeats, replace=False) if repeats else np.empty(0, np.int64)
    scores = logits + rng.gumbel(size=logits.size)
    scores[kept] = -np.inf
    fresh = np.argpartition(-scores, k - repeats)[:k - repeats]
    return np.sort(np.concatenate([kept, fresh]))


def sequence(rng, tokens: int, exponent: float, reuse: float, phase: int = 0,
             logits: list | None = None) -> list:
    """[token][module] sorted expert ids of one decode sequence."""
    logits = logits if logits is not None else zipf_logits(rng, exponent)
    out, previous = [], [None] * len(MODULES)
    for t in range(tokens):
        if phase and t and t % phase == 0:
            logits = zipf_logits(rng, exponent)  # a new topic
        previous = [route(rng, lg, k, prev, reuse)
                    for lg, (_, k), prev in zip(logits, MODULES, previous)]
        out.append(previous)
    return out


def make_traces(args) -> dict:
    """Name -> calls [(module index, sorted experts)] in the order the forward makes them."""
    def rng(i):
        return np.random.default_rng([args.seed, i])

    skew = (args.exponent, args.reuse)
    seqs = {"random": [sequence(rng(0), args.tokens, 0.0, 0.0)],
            "skewed": [sequence(rng(1), args.tokens, *skew)],
            "phase": [sequence(rng(2), args.tokens, *skew, phase=args.phase)]}
    shared = zipf_logits(rng(3), args.exponent)
    seqs["batch4"] = [sequence(rng(4 + b), args.tokens, *skew, logits=shared)
                      for b in range(BATCH)]
    # Python ints: `_admit` only iterates them, and that runs faster than over numpy ints
    return {name: [(m, sorted(set().union(*(s[t][m].tolist() for s in group))))
                   for t in range(args.tokens) for m in range(len(MODULES))]
            for name, group in seqs.items()}


# ------------------------------------------------------------------------------ policies

def next_uses(calls: list) -> list:
    """Per call: key -> the index of the next call that routes to it (inf: none)."""
    out, seen = [], {}
    for t in range(len(calls) - 1, -1, -1):
        m, experts = calls[t]
        keys = [(m, e) for e in experts]
        out.append({key: seen.get(key, math.inf) for key in keys})
        seen.update(dict.fromkeys(keys, t))
    return out[::-1]


class Belady:
    """Offline optimum (MIN): the victims are the resident keys used again farthest ahead.
    Knows the whole trace (`next_uses`); a max-heap of (next use, key), stale entries skipped."""

    def __init__(self, next_use: list):
        self.clock = 0
        self.next_use = next_use
        self.due: dict = {}   # resident key -> its next use
        self.heap: list = []  # (-next use, key)

    def use(self, keys) -> None:
        ahead = self.next_use[self.clock]
        self.clock += 1
        for key in keys:
            self.due[key] = ahead[key]
            heapq.heappush(self.heap, (-ahead[key], key))

    def forget(self, key) -> None:
        self.due.pop(key, None)

    def victims(self, count: int, keep: set) -> list:
        out, kept = [], []
        while self.heap and len(out) < count:
            entry = heapq.heappop(self.heap)
            if self.due.get(entry[1]) != -entry[0]:
                continue  # stale
            (kept if entry[1] in keep else out).append(entry)
        for entry in kept + out:  # still resident until the store forgets them
            heapq.heappush(self.heap, entry)
        return [key for _, key in out]


class Unbounded:
    """Every expert keeps its slot (the pool holds them all): the compulsory misses only."""

    def use(self, keys) -> None:
        pass

    def forget(self, key) -> None:
        raise AssertionError("nothing is evicted with a slot per expert")

    def victims(self, count: int, keep: set) -> list:
        raise AssertionError("nothing is evicted with a slot per expert")


# ------------------------------------------------------------------------------ the store

class SimPool:
    """What `ExpertStore._admit` reads of a `Pool`: its slot count, map, free list, policy."""

    def __init__(self, slots: int, policy):
        self.slots, self.policy = slots, policy
        self.slot_of: dict = {}
        self.free = list(range(slots - 1, -1, -1))


class SimStore(ExpertStore):
    """An `ExpertStore` without modules, arrays or reader: `_admit` is the store's own, `_load`
    takes free slots as the real one does and reads nothing."""

    def __init__(self):
        self.stats = ExpertStats()

    def _load(self, pool: SimPool, keys: list) -> None:
        for key in keys:
            pool.slot_of[key] = pool.free.pop()
        self.stats.loads += len(keys)


def hit_rate(calls: list, slots: int, policy) -> float:
    store, pool = SimStore(), SimPool(slots, policy)
    for m, experts in calls:
        store._admit(pool, m, experts)
    return store.stats.hit_rate


def policies(args, ahead: list) -> dict:
    """Column name -> a fresh policy for one run."""
    out = {"LRU": LRU()}
    for h in args.half_life:
        for g in args.guard:
            out[f"LFRU h={h:g} g={g:g}"] = LFRU(len(MODULES), h, g)
    out["Belady"] = Belady(ahead)
    return out


# ------------------------------------------------------------------------------ report

def measure(args, traces: dict) -> list:
    total = sum(n for n, _ in MODULES)
    rows = []
    for name, calls in traces.items():
        ceiling = hit_rate(calls, total, Unbounded())
        ahead = next_uses(calls)
        for budget in args.budgets:
            slots = int(budget * total)
            rates = {col: hit_rate(calls, slots, p) for col, p in policies(args, ahead).items()}
            rows.append((name, budget, slots, rates, ceiling))
    return rows


def table(rows: list) -> str:
    cols = list(rows[0][3])
    lfru = [c for c in cols if c.startswith("LFRU")]
    head = (["trace", "budget", "slots"] + cols + [f"{c} / LRU" for c in lfru]
            + ["unbounded"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, budget, slots, rates, ceiling in rows:
        cells = [name, f"{100 * budget:g} %", f"{slots:,}"]
        cells += [f"{100 * rates[c]:.1f}" for c in cols]
        cells += [f"{rates[c] / rates['LRU']:.3f}" for c in lfru]
        cells.append(f"{100 * ceiling:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=400, help="decode tokens per trace")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--half-life", type=float, nargs="+", default=[DEFAULT_HALF_LIFE],
                        help="LFRU half-lives to run, in steps of one module (~tokens)")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.25, 0.5],
                        help="slots as fractions of all routed experts")
    parser.add_argument("--guard", type=float, nargs="+", default=[1.0],
                        help="LFRU recency guards to run, per half-life, in tokens (0: none)")
    parser.add_argument("--exponent", type=float, default=1.1, help="Zipf exponent")
    parser.add_argument("--reuse", type=float, default=0.5,
                        help="chance a routed expert repeats one of the previous token's")
    parser.add_argument("--phase", type=int, default=100, help="tokens per topic (phase)")
    args = parser.parse_args()
    print("`python benchmarks/bench_expert_policy.py " + " ".join(sys.argv[1:]) + "`\n")
    tic = time.perf_counter()
    rows = measure(args, make_traces(args))
    print("hit rate, % of routed experts (per call, distinct)\n")
    print(table(rows))
    print(f"\n{time.perf_counter() - tic:.1f} s")


if __name__ == "__main__":
    main()
