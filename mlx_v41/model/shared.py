"""State that crosses layers within one forward, made explicit.

Only 4 layers own global KV; Reuse and Reindex layers read an owner's compressed rows and index
keys, Reuse layers take an index layer's top-k, and Reindex layers restrict their indexer to the
candidate source's pool. `SharedKV` is everything the readers of one owner share: it is what a
pipeline stage on another rank has to receive. `ForwardState` carries the call's positions, the
per-owner state and the optional inputs/outputs (teacher-forced block inputs, taps, capture).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx

from ..cache.layer import CompressedKV
from ..kernels import Kernels


@dataclass
class SharedKV:
    """One kv owner's global state as its readers see it during a forward."""

    owner: int                                  # the layer that stores the compressed KV
    store: CompressedKV                         # packed KV rows and index keys (the cache's)
    selections: dict = field(default_factory=dict)  # index layer -> top-k [B, n, k] (-1 empty)
    pool: Optional[mx.array] = None             # candidate blocks [B, n, blocks] (bool)


@dataclass
class BlockInputs:
    """Teacher forcing: given block inputs replace the model's own, per layer (the block's
    caches and its owner's shared state are then built from them in the same forward, as the
    reference builds them). Rows cover every position of the call.

    streams: layer -> [B, S, hc, D] streams entering the block (before its Engram write).
    pre: layer -> [B, S, hc] float32 `pre` mix the block receives.
    topk: layer -> [B, S, k] int32 selections that replace an index layer's own (-1 empty).
    pool: layer -> [B, S, blocks] bool candidate blocks that replace the source's own.
    """

    streams: dict = field(default_factory=dict)
    pre: dict = field(default_factory=dict)
    topk: dict = field(default_factory=dict)
    pool: dict = field(default_factory=dict)


@dataclass
class ForwardState:
    """Everything one forward call over positions [start, end) shares across layers."""

    start: int                                   # first position of this call
    end: int                                     # one past the last position
    shared: dict                                 # kv owner -> SharedKV
    engram_rows: Optional[mx.array] = None       # [B, S, n_engram_layers, columns]
    image_mask: Optional[mx.array] = None        # [B, end - start] bool: image-span positions
    precompressed: set = field(default_factory=set)  # owners whose compressor already ran
    truncate_window: bool = False                # bounded replay: no rows before the span
    compat_index_k_source: Optional[int] = None  # reference defect D1 switch (parity only)
    kernels: Kernels = field(default_factory=Kernels)  # Metal kernels where they apply
    teacher: Optional[BlockInputs] = None        # block-isolated parity
    tap_layers: tuple = ()                       # layers whose entering streams are returned
    taps: dict = field(default_factory=dict)     # layer -> [B, rows, D] mean over the copies
    tap_keep: Optional[int] = None               # taps keep only their last rows (None: all)
    capture: Optional[dict] = None               # debugging: name -> intermediate
    # layer -> (its entering streams, their attention-side (pre, post, comb)): made with the
    # previous block's expand in one launch where the fused kernel applies (Block.__call__)
    handed_mixes: dict = field(default_factory=dict)

    def image_positions(self, rows: int) -> Optional[mx.array]:
        """The image mask of the call's last `rows` positions (None: no image in the call)."""
        return None if self.image_mask is None else self.image_mask[:, -rows:]

    def record(self, name: str, value: mx.array) -> None:
        if self.capture is not None:
            self.capture[name] = value


def shared_state(cache: list, roles) -> dict:
    """A SharedKV for every kv owner of the cache (the readers find theirs by `kv_owner`)."""
    return {i: SharedKV(i, c.compressed) for i, c in enumerate(cache)
            if c.compressed is not None and roles[i].kv_owner == i}
