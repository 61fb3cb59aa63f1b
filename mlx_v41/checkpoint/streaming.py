"""`load_model(..., expert_memory=...)`: whether the routed experts are held in memory or
streamed from the model folder's files under a budget (`model/expert_store.py`), and where
each expert's bytes lie in the published and converted layouts.

`expert_memory`: "auto" (default): resident when every weight fits the machine's working set
with room for the caches, else streamed with the room that is left; "resident"; or a budget
in bytes (an int, or a string with a unit: "48GB", "512MB", "40GiB"), which streams.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Union

import mlx.core as mx

from ..errors import CheckpointError
from ..sizes import EXAMPLES, parse_size
from ..model.expert_policy import DEFAULT_POLICY
from ..model.expert_reader import DEFAULT_THREADS, FileReader, Region
from ..model.expert_store import ExpertStore, Layout, check_regions, detach_experts
from ..model.memory import human_bytes as _h, measure_weights, session_bytes

AUTO, RESIDENT = "auto", "resident"
KV_RESERVE_FRACTION = 0.10   # auto: share of the working set kept for caches and activations
KV_RESERVE_TOKENS = 131072   # auto: and at least one session of this many tokens
DTYPES = {"U32": mx.uint32, "U8": mx.uint8, "BF16": mx.bfloat16, "F16": mx.float16,
          "F32": mx.float32}


def parse_memory_size(value: Union[int, str]) -> int:
    """Bytes from an int or a size such as "48GB", "40GiB" or "1e9" (`mlx_v41.sizes`); a
    ValueError naming `expert_memory` otherwise."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    try:
        size = parse_size(value) if isinstance(value, str) else 0
    except ValueError:
        size = 0
    if size < 1:
        raise ValueError(f"expert_memory: {value!r} is not a memory size ({EXAMPLES}), "
                         "'auto' or 'resident'")
    return size


def working_set() -> int:
    """Bytes the model may use: the device's recommended working set (on a Mac; the physical
    memory elsewhere), lowered by `mx.set_memory_limit` when it is set below that."""
    info = mx.device_info()
    total = info.get("max_recommended_working_set_size") or info.get("memory_size") or \
        os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = mx.set_memory_limit(total)  # reads the limit (the call returns the previous one)
    mx.set_memory_limit(limit)
    return int(min(total, limit))


@dataclass(frozen=True)
class ExpertPlan:
    """What a load does with the routed experts, and why (`line()`: the one line commands
    print)."""

    streamed: bool
    budget: int             # bytes of expert slots (all experts' bytes when resident)
    expert_bytes: int       # every routed expert
    other_bytes: int        # every other resident weight
    minimum: int            # the smallest budget that runs (one expert per layout)
    reason: str

    def line(self) -> str:
        if not self.streamed:
            return f"experts: resident ({_h(self.expert_bytes)}; {self.reason})"
        return (f"experts: streamed from SSD, {_h(self.budget)} of {_h(self.expert_bytes)} "
                f"in memory ({self.reason})")


def plan_experts(expert_memory, expert_bytes: int, other_bytes: int, minimum: int, cfg,
                 memory: Optional[int] = None, kv_bytes: Optional[int] = None) -> ExpertPlan:
    """The `ExpertPlan` for an `expert_memory` setting; `memory`: the working set for "auto"
    (default: `working_set()`); `kv_bytes`: what "auto" keeps for caches at least (default:
    one session of `KV_RESERVE_TOKENS`). A budget below `minimum` or above `expert_bytes` is
    a ValueError naming both."""
    every = (expert_bytes, other_bytes, minimum)
    if expert_memory is None or expert_memory == AUTO:
        memory = working_set() if memory is None else memory
        kv_bytes = session_bytes(cfg, KV_RESERVE_TOKENS) if kv_bytes is None else kv_bytes
        reserve = max(int(KV_RESERVE_FRACTION * memory), kv_bytes)
        room = memory - reserve - other_bytes
        if room >= expert_bytes:
            return ExpertPlan(False, expert_bytes, *every,
                              f"auto: {_h(expert_bytes + other_bytes)} of weights fit the "
                              f"{_h(memory)} working set with {_h(reserve)} for caches")
        if room < minimum:
            raise ValueError(f"the model does not fit this machine even with its experts "
                             f"streamed: {_h(other_bytes)} of other weights, {_h(reserve)} "
                             f"for caches and at least {_h(minimum)} of expert slots exceed "
                             f"the {_h(memory)} working set")
        return ExpertPlan(True, room, *every,
                          f"auto: {_h(expert_bytes + other_bytes)} of weights exceed the "
                          f"{_h(memory)} working set; {_h(reserve)} kept for caches")
    if expert_memory == RESIDENT:
        memory = working_set() if memory is None else memory
        if expert_bytes + other_bytes > memory:
            raise ValueError(f"expert_memory: the weights ({_h(expert_bytes + other_bytes)}) "
                             f"do not fit this machine's {_h(memory)} working set resident: "
                             "use --expert-memory SIZE (or auto) to stream the routed experts")
        return ExpertPlan(False, expert_bytes, *every, "expert_memory='resident'")
    budget = parse_memory_size(expert_memory)
    if budget < minimum:
        raise ValueError(f"expert_memory: {_h(budget)} is below the minimum of "
                         f"{_h(minimum)} ({minimum} bytes: one expert of each layout)")
    if budget > expert_bytes:
        raise ValueError(f"expert_memory: {_h(budget)} is more than all the routed experts "
                         f"({_h(expert_bytes)}, {expert_bytes} bytes): use 'resident' or "
                         "a smaller budget")
    return ExpertPlan(True, budget, *every, f"expert_memory={expert_memory}")


class ExpertStreaming:
    """A load's streamed experts: made by `setup` (which detaches the modules), filled with
    the regions the loaders find, turned into the model's `ExpertStore` by `finish`."""

    def __init__(self, model, plan: ExpertPlan):
        self.plan = plan
        self.modules = detach_experts(model)
        self.index = {path: i for i, (path, _, _) in enumerate(self.modules)}
        self.regions = [[[None] * len(layout.parts) for _ in range(module.expert_count)]
                        for _, module, layout in self.modules]

    def owns(self, path: str) -> bool:
        """Whether the module at `path` (a `SwitchMLP`) is streamed."""
        return path in self.index

    def count(self, path: str) -> int:
        return self.modules[self.index[path]][1].expert_count

    def add(self, path: str, proj: str, leaf: str, expert: int, region: Region) -> None:
        """Where part `proj.leaf` of the module's expert `expert` (its own index) lies."""
        index = self.index[path]
        layout: Layout = self.modules[index][2]
        part = next(i for i, p in enumerate(layout.parts) if (p.proj, p.leaf) == (proj, leaf))
        self.regions[index][expert][part] = region

    def part(self, path: str, proj: str, leaf: str):
        """The layout `Part` of `proj.leaf` in module `path` (None: the layout has none)."""
        layout: Layout = self.modules[self.index[path]][2]
        return next((p for p in layout.parts if (p.proj, p.leaf) == (proj, leaf)), None)

    def finish(self, model, policy: str = DEFAULT_POLICY, threads: int = DEFAULT_THREADS,
               prefetch: int = 0, cache_pages: bool = False) -> ExpertStore:
        check_regions(self.modules, self.regions)
        store = ExpertStore(self.modules, self.regions, self.plan.budget, policy,
                            FileReader(threads, cache_pages), _gates(model, self.modules),
                            prefetch)
        model.expert_store = store
        return store


def _gates(model, modules: list) -> list:
    """Per streamed module, (its MoE's router, the first expert id of its table)."""
    named = dict(model.named_modules())
    out = []
    for path, _, _ in modules:
        moe = named.get(path.removesuffix(".experts.switch_mlp"))
        gate = getattr(moe, "gate", None)
        out.append(None if gate is None else (gate, getattr(moe, "first_expert", 0)))
    return out


def setup(model, expert_memory, cfg, memory: Optional[int] = None) -> tuple:
    """(ExpertPlan, ExpertStreaming or None) for a built, not yet loaded `model` whose
    quantized layouts are final."""
    sizes = measure_weights(model)
    plan = plan_experts(expert_memory, sizes.experts, sizes.resident, sizes.minimum, cfg, memory)
    if not plan.streamed or not sizes.experts:
        return plan, None
    return plan, ExpertStreaming(model, plan)


def converted_regions(streaming: ExpertStreaming, header, path, key: str, first: int) -> None:
    """The per-expert regions of a converted folder's stacked tensor `key` ([E, ...], expert e
    at `e` times the per-expert bytes), this module's experts from `first` on."""
    module, _, leaf = key.rpartition(".")
    switch, _, proj = module.rpartition(".")
    part = streaming.part(switch, proj, leaf)
    if part is None:
        raise CheckpointError(f"{path}: tensor {key} is not a parameter of this model")
    shape, dtype = header.shape(key), header.dtype(key)
    count = streaming.count(switch)
    if DTYPES.get(dtype) != part.dtype or tuple(shape[1:]) != part.shape \
            or shape[0] < first + count:
        raise CheckpointError(f"{path}: tensor {key} has {dtype} {list(shape)}, expected "
                              f"{part.dtype} [experts, {', '.join(map(str, part.shape))}]")
    begin, end = header.entries[key]["data_offsets"]
    each = (end - begin) // shape[0]
    for i in range(count):
        streaming.add(switch, proj, leaf, i, Region(str(path), header.start + begin +
                                                    (first + i) * each, each, key))
