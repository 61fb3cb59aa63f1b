"""Which rank runs which layers, and what crosses each boundary between two ranks.

A pipeline gives each rank a contiguous range of backbone layers; rank 0 also holds the token
embedding, the last rank the final norm and the head. Chosen by resident weight bytes (Engram
tables are memory-mapped, so they are not counted), or given as the first layer of each rank
after rank 0 (`--pipeline 20`, `--pipeline 10,26`).
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx.utils import tree_flatten


class SplitError(ValueError):
    """A pipeline split that cannot be used (the message names it)."""


@dataclass(frozen=True)
class Crossing:
    """What the layers from `slot` on need from the layers before it: the residual streams and
    `pre`, plus the shared state of earlier layers (spec/model.md, CSA2)."""

    slot: int
    owners: tuple       # kv owners below `slot` read at or after it: their new packed rows
    selections: tuple   # (kv owner, index layer) top-k selections Reuse layers read
    pools: tuple        # kv owners whose candidate pool a Reindex layer at/after it reads


def crossing(roles, n_layers: int, slot: int, candidate_source: int) -> Crossing:
    late = [r for r in roles[slot:n_layers] if r.ratio]
    owners = sorted({r.kv_owner for r in late if r.kv_owner < slot})
    selections = sorted({(r.kv_owner, r.topk_owner) for r in late
                         if not r.has_indexer and r.topk_owner < slot})
    pools = sorted({r.kv_owner for r in late if r.uses_candidates}) \
        if 0 <= candidate_source < slot else []
    return Crossing(slot, tuple(owners), tuple(selections), tuple(pools))


def parse_split(text: str, n_layers: int, size: int) -> list:
    """'20' or '10,26' (first layer of ranks 1..) -> [(start, end)] per rank."""
    try:
        cuts = [int(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        raise SplitError(f"--pipeline split {text!r}: expected the first layer of each rank "
                         "after rank 0, e.g. 20 or 10,26") from None
    if len(cuts) != size - 1:
        raise SplitError(f"--pipeline split {text!r} gives {len(cuts) + 1} stages, but "
                         f"{size} ranks were launched")
    bounds = [0] + cuts + [n_layers]
    if any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise SplitError(f"--pipeline split {text!r}: layers must increase strictly inside "
                         f"(0, {n_layers}) so every rank gets at least one layer")
    return list(zip(bounds, bounds[1:]))


def layer_bytes(model) -> list:
    """Resident parameter bytes of each backbone layer (shapes only: nothing is evaluated)."""
    layers = model.model.layers
    return [sum(v.nbytes for _, v in tree_flatten(layer.parameters())) for layer in layers]


def balanced_split(model, size: int) -> list:
    """Contiguous ranges whose weights (the embedding on rank 0, the head on the last) come
    closest to equal shares: each cut at the layer nearest the running share."""
    sizes = layer_bytes(model)
    n = len(sizes)
    if size > n:
        raise SplitError(f"{size} ranks but only {n} layers: a pipeline stage needs a layer")
    sizes[0] += model.model.embed_tokens.weight.nbytes
    sizes[-1] += model.lm_head.weight.nbytes
    total, cuts, running = sum(sizes), [], 0
    for i, s in enumerate(sizes):
        target = total * (len(cuts) + 1) / size
        if len(cuts) < size - 1 and i > (cuts[-1] if cuts else 0) and \
                abs(running - target) <= abs(running + s - target):
            cuts.append(i)
        running += s
    while len(cuts) < size - 1:  # tiny models: the last ranks get one layer each
        cuts.append(max(cuts[-1] + 1 if cuts else 1, n - (size - 1 - len(cuts))))
    bounds = [0] + cuts + [n]
    return list(zip(bounds, bounds[1:]))
