"""Routed experts streamed from the model folder under a memory budget: at most `budget` bytes
of experts are held, in slots; a forward reads the missing experts it routes to. Everything
else of the model stays resident.

Slots: each expert layout (its projections' packed shapes and dtypes; one for the official
checkpoint and for every recipe) has one pool of slots, three `SwitchLinear` tables
[slots, ...] that every MoE module of that layout shares (the backbone's and the drafter's).
A MoE call (`StreamedSwitchMLP`):
1. evaluates the router's ids (the experts must be known to be read);
2. admits the call's distinct experts: resident ones are hits; missing ones are read
   (concurrently, `expert_reader.py`) into free slots or the policy's victims' slots
   (`expert_policy.py`), at most `READ_BATCH` experts staged at a time;
3. runs `expert_products` over the pool with the ids mapped to slots: the same kernels over the
   same bytes as the resident model, so the same bits;
4. evaluates the products: no pending computation then reads a slot that a later call
   overwrites (slot writes are in place).
A call that routes to more distinct experts than the pool holds runs in waves of at most a
pool's worth of experts, each wave over its own (token, expert) pairs; the pairs' products do
not depend on each other, so the result is the same. A prefill chunk reads each expert it
routes to once (per wave).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .expert_policy import DEFAULT_POLICY, make_policy
from .expert_prefetch import ReadAhead
from ..errors import CheckpointError
from .expert_reader import FileReader
from .layers import input_dims
from .memory import PROJECTIONS, human_bytes
from .moe import SwitchLinear, SwitchMLP, expert_products

LEAVES = ("weight", "scales", "biases")
READ_BATCH = 16  # experts staged in host memory at a time (beside the slots)


@dataclass(frozen=True)
class Part:
    """One array of one expert: `leaf` of projection `proj`, [*shape] of `dtype`."""

    proj: str
    leaf: str
    shape: tuple
    dtype: mx.Dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.size


@dataclass(frozen=True)
class Layout:
    """What a slot holds: the parts of one expert, and each projection's quantization."""

    parts: tuple
    quantization: tuple  # per projection: (mode, bits, group_size, output dims, input dims)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


@dataclass
class ExpertStats:
    """Counters of a streamed run (`ExpertStore.stats`); `reset()` starts them again."""

    calls: int = 0          # MoE calls
    routed: int = 0         # distinct experts per call, summed
    hits: int = 0           # of them resident when the call came
    loads: int = 0          # experts read
    bytes_read: int = 0
    read_seconds: float = 0.0   # in reads (threads reading concurrently)
    wait_seconds: float = 0.0   # the forward waited: reads and slot writes
    waves: int = 0          # calls that needed more than one wave
    read_ahead: int = 0     # loads found read ahead (`expert_prefetch.py`)
    ahead_unused_bytes: int = 0  # read ahead and never used (disk traffic beyond the loads)

    def snapshot(self) -> "ExpertStats":
        return dataclasses.replace(self)

    def since(self, earlier: "ExpertStats") -> "ExpertStats":
        """The counts between `earlier` (a snapshot) and now."""
        return ExpertStats(*(getattr(self, f.name) - getattr(earlier, f.name)
                             for f in dataclasses.fields(self)))

    @property
    def hit_rate(self) -> float:
        return self.hits / self.routed if self.routed else 0.0

    @property
    def read_bandwidth(self) -> float:
        return self.bytes_read / self.read_seconds if self.read_seconds else 0.0

    def as_dict(self) -> dict:
        return {"calls": self.calls, "routed": self.routed, "hits": self.hits,
                "loads": self.loads, "hit_rate": round(self.hit_rate, 4),
                "bytes_read": self.bytes_read, "read_seconds": round(self.read_seconds, 4),
                "read_bandwidth": round(self.read_bandwidth), "waves": self.waves,
                "read_ahead": self.read_ahead, "ahead_unused_bytes": self.ahead_unused_bytes,
                "wait_seconds": round(self.wait_seconds, 4)}

    def summary(self) -> str:
        unused = f" (+{human_bytes(self.ahead_unused_bytes)} read ahead unused)" \
            if self.ahead_unused_bytes else ""
        return (f"hit rate {100 * self.hit_rate:.1f} % of {self.routed:,} routed, "
                f"{human_bytes(self.bytes_read)} read{unused} at "
                f"{human_bytes(self.read_bandwidth)}/s, {self.wait_seconds:.2f} s waiting on "
                "reads")


class Pool:
    """The slots of one layout: three `SwitchLinear` tables and who holds each slot."""

    def __init__(self, layout: Layout, slots: int, modules: int, policy: str):
        self.layout, self.slots = layout, slots
        self.linears = {}
        for proj, (mode, bits, group, out_dims, in_dims) in zip(PROJECTIONS,
                                                                 layout.quantization):
            self.linears[proj] = SwitchLinear(in_dims, out_dims, slots, mode, bits, group)
        mx.eval([lin.parameters() for lin in self.linears.values()])  # allocated now
        self.slot_of: dict = {}  # (module index, expert) -> slot
        self.free = list(range(slots - 1, -1, -1))
        self.policy = make_policy(policy, modules)

    @property
    def nbytes(self) -> int:
        return self.slots * self.layout.nbytes

    def tables(self):
        return self.linears["gate_proj"], self.linears["up_proj"], self.linears["down_proj"]


class StreamedSwitchMLP(SwitchMLP):
    """A `SwitchMLP` whose experts live in an `ExpertStore` (its own arrays dropped)."""

    @property
    def n_experts(self) -> int:
        return self.expert_count

    def __call__(self, x, ids, weights):
        return self.store.run(self.store_index, x, ids, weights)


def expert_layout(switch: SwitchMLP) -> Layout:
    """The layout of one expert of a resident (possibly unloaded) `SwitchMLP`."""
    parts, quantization = [], []
    for proj in PROJECTIONS:
        lin = getattr(switch, proj)
        for leaf in LEAVES:
            if leaf in lin:
                parts.append(Part(proj, leaf, tuple(lin[leaf].shape[1:]), lin[leaf].dtype))
        quantization.append((lin.mode, lin.bits, lin.group_size, lin.weight.shape[-2],
                             input_dims(lin)))
    return Layout(tuple(parts), tuple(quantization))


def detach_experts(model) -> list:
    """Turn every `SwitchMLP` of `model` into a `StreamedSwitchMLP` without arrays; -> [(module
    path, module, layout)] in the model's module order. Before the weights are loaded."""
    out = []
    for path, module in model.named_modules():
        if type(module) is not SwitchMLP:
            continue
        layout = expert_layout(module)
        count = module.n_experts
        for proj in PROJECTIONS:
            lin = getattr(module, proj)
            for leaf in LEAVES:
                if leaf in lin:
                    del lin[leaf]
        module.__class__ = StreamedSwitchMLP
        module.expert_count = count
        out.append((path, module, layout))
    return sorted(out, key=lambda entry: entry[0])


class ExpertStore:
    """The slots, the reader and the counters of a streamed model (module docstring).

    Args:
        modules: [(path, StreamedSwitchMLP, Layout)] from `detach_experts`.
        regions: per module, per expert, one `Region` per part of its layout.
        budget: bytes of slots, split between the layouts by their experts' bytes.
        policy: eviction policy name (`expert_policy.POLICIES`).
        reader: a `FileReader` (default: 8 threads, out of the page cache).
        gates: per module, (its MoE's router, the first expert id of its table): what the
            read-ahead predicts with (`expert_prefetch.py`); None: no read-ahead.
        prefetch: experts read ahead at most, in host buffers beside the slots (0: off).
    """

    def __init__(self, modules: list, regions: list, budget: int, policy: str = DEFAULT_POLICY,
                 reader: FileReader | None = None, gates: list | None = None,
                 prefetch: int = 0):
        self.modules, self.regions, self.budget = modules, regions, budget
        self.reader = reader or FileReader()
        self.stats = ExpertStats()
        self.ahead = ReadAhead(self.reader, regions, gates or [None] * len(modules),
                               prefetch if gates else 0, self.stats)
        layouts = {}
        for _, module, layout in modules:
            layouts[layout] = layouts.get(layout, 0) + module.expert_count
        total = sum(layout.nbytes * count for layout, count in layouts.items())
        self.expert_bytes = total
        self.pools = {}
        for layout, count in layouts.items():
            share = budget * layout.nbytes * count // total
            slots = min(max(share // layout.nbytes, 1), count)
            users = sum(1 for _, _, lay in modules if lay == layout)
            self.pools[layout] = Pool(layout, slots, users, policy)
        for index, (_, module, layout) in enumerate(modules):
            module.store, module.store_index = self, index
            module.pool = self.pools[layout]

    @property
    def nbytes(self) -> int:
        """Bytes of the slots."""
        return sum(pool.nbytes for pool in self.pools.values())

    @property
    def slots(self) -> int:
        return sum(pool.slots for pool in self.pools.values())

    def describe(self) -> str:
        return (f"{human_bytes(self.nbytes)} of {human_bytes(self.expert_bytes)} of routed "
                f"experts in memory ({self.slots:,} slots of "
                f"{sum(m.expert_count for _, m, _ in self.modules):,} experts)")

    def close(self) -> None:
        self.reader.close()

    # ---------------------------------------------------------------- the forward's call

    def run(self, index: int, x: mx.array, ids: mx.array, weights: mx.array) -> mx.array:
        """`SwitchMLP.__call__` of module `index` with its experts in the slots."""
        module = self.modules[index][1]
        pool = module.pool
        chosen = np.array(ids).astype(np.int64)  # evaluates the router
        experts = np.unique(chosen)
        self.stats.calls += 1
        self.ahead.begin(index)
        try:
            if experts.size <= pool.slots:
                slots = self._admit(pool, index, experts)
                out = expert_products(*pool.tables(), module.limit, x,
                                      _mapped(chosen, experts, slots), weights)
                self.ahead.predict(index, x, pool, pool.layout.parts)  # read while computing
                mx.eval(out)
                return out
            self.stats.waves += 1
            return self._run_waves(pool, index, module.limit, x, chosen, experts, weights)
        finally:
            self.ahead.end(index)

    def _run_waves(self, pool: Pool, index: int, limit: float, x, chosen, experts, weights):
        tokens, k = chosen.shape
        flat = chosen.reshape(-1)
        # The resident experts first, before the wave's reads could evict them.
        resident = np.array([(index, int(e)) in pool.slot_of for e in experts])
        ordered = np.concatenate([experts[resident], experts[~resident]])
        outs, picked = [], []
        flat_weights = weights.reshape(-1)
        for start in range(0, ordered.size, pool.slots):
            wave = np.sort(ordered[start:start + pool.slots])
            slots = self._admit(pool, index, wave)
            pairs = np.flatnonzero(np.isin(flat, wave))
            where = mx.array(pairs.astype(np.uint32))
            out = expert_products(*pool.tables(), limit, x[where // k],
                                  _mapped(flat[pairs][:, None], wave, slots),
                                  flat_weights[where][:, None])
            mx.eval(out)  # before the next wave overwrites slots it read
            outs.append(out[:, 0])
            picked.append(pairs)
        inverse = np.argsort(np.concatenate(picked))
        return mx.concatenate(outs)[mx.array(inverse.astype(np.uint32))].reshape(tokens, k, -1)

    def _admit(self, pool: Pool, index: int, experts: np.ndarray) -> np.ndarray:
        """Slots holding `experts` (sorted, at most `pool.slots`) of module `index`, reading
        the missing ones."""
        keys = [(index, int(e)) for e in experts]
        missing = [key for key in keys if key not in pool.slot_of]
        self.stats.routed += len(keys)
        self.stats.hits += len(keys) - len(missing)
        short = len(missing) - len(pool.free)
        if short > 0:
            for victim in pool.policy.victims(short, set(keys)):
                pool.free.append(pool.slot_of.pop(victim))
                pool.policy.forget(victim)
        if missing:
            tic = time.perf_counter()
            for start in range(0, len(missing), READ_BATCH):
                self._load(pool, missing[start:start + READ_BATCH])
            self.stats.wait_seconds += time.perf_counter() - tic
        pool.policy.use(keys)
        return np.array([pool.slot_of[key] for key in keys], dtype=np.int64)

    def _load(self, pool: Pool, keys: list) -> None:
        """Read `keys` into free slots (a failed read leaves the slots free); those read
        ahead are taken from the read-ahead."""
        parts = pool.layout.parts
        staging = [np.empty((len(keys), part.nbytes), np.uint8) for part in parts]
        jobs = []
        tic = time.perf_counter()
        for i, (index, expert) in enumerate(keys):
            ahead = self.ahead.take((index, expert))
            if ahead is None:
                jobs += [(self.regions[index][expert][p], staging[p][i])
                         for p in range(len(parts))]
                continue
            for p, buffer in enumerate(ahead):
                staging[p][i] = buffer
            self.stats.read_ahead += 1
        self.reader.read_all(jobs)
        self.stats.read_seconds += time.perf_counter() - tic
        slots = [pool.free.pop() for _ in keys]
        where = mx.array(slots, dtype=mx.uint32)
        for part, data in zip(parts, staging):
            table = pool.linears[part.proj][part.leaf]
            table[where] = mx.array(data).view(part.dtype).reshape(len(keys), *part.shape)
        mx.eval([lin.parameters() for lin in pool.linears.values()])
        for key, slot in zip(keys, slots):
            pool.slot_of[key] = slot
        self.stats.loads += len(keys)
        self.stats.bytes_read += sum(s.nbytes for s in staging)


def _mapped(chosen: np.ndarray, experts: np.ndarray, slots: np.ndarray) -> mx.array:
    """The routed ids [T, k] as slot numbers (`experts` sorted, `slots` aligned with them)."""
    return mx.array(slots[np.searchsorted(experts, chosen)].astype(np.uint32))


def check_regions(modules: list, regions: list) -> None:
    """Every part of every expert has a region of the part's size (else a CheckpointError
    naming the tensor)."""
    for (path, module, layout), per_expert in zip(modules, regions):
        for expert in range(module.expert_count):
            found = per_expert[expert] if expert < len(per_expert) else None
            for p, part in enumerate(layout.parts):
                region = found[p] if found else None
                if region is None:
                    raise CheckpointError(f"no checkpoint tensor for {part.proj}.{part.leaf} "
                                          f"of routed expert {expert} of {path}")
                if region.nbytes != part.nbytes:
                    raise CheckpointError(f"{region.path}: tensor {region.tensor} holds "
                                          f"{region.nbytes} bytes per expert, expected "
                                          f"{part.nbytes} ({path}.{part.proj}.{part.leaf})")


__all__ = ["ExpertStore", "ExpertStats", "StreamedSwitchMLP", "detach_experts",
           "check_regions", "Layout", "Part"]
