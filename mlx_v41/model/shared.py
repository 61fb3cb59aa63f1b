"""State that crosses layers within one forward, made explicit.

Only 4 layers own global KV; Reuse and Reindex layers read an owner's compressed rows and index
keys, Reuse layers take an index layer's top-k, and Reindex layers restrict their indexer to the
candidate source's pool. `SharedKV` is everything the readers of one owner share: it is what a
pipeline stage on another rank has to receive. `ForwardState` carries the call's positions, the
per-owner state and the taps; a `Probe` carries the instrumentation (teacher-forced block
inputs, captures) and is absent in production.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx

from ..cache.layer import CompressedKV


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
class Taps:
    """The streams entering given layers, returned by the forward: the mean over the copies
    [B, rows, D] bf16 of each tapped layer's input (before its Engram write). DSpark's drafter
    reads its target layers'; a caller may ask for others (`Model.forward(taps=...)`)."""

    layers: tuple = ()                        # the tapped layers
    keep: Optional[int] = None                # keep only the last rows (None: all)
    rows: dict = field(default_factory=dict)  # layer -> [B, rows, D], the call's so far

    def record(self, layer: int, streams: mx.array) -> None:
        if layer not in self.layers:
            return
        tap = mx.mean(streams, axis=2)
        previous = self.rows.get(layer)
        tap = tap if previous is None else mx.concatenate([previous, tap], axis=1)
        self.rows[layer] = tap if self.keep is None else tap[:, -self.keep:]


@dataclass
class Probe:
    """Instrumentation of one forward, absent in production: teacher-forced block inputs
    (block-isolated parity) and a capture dict that receives intermediates named like the
    reference goldens (`layers.L.out`, ...)."""

    teacher: Optional[BlockInputs] = None
    capture: Optional[dict] = None

    def replaces_input(self, layer: int) -> bool:
        return self.teacher is not None and layer in self.teacher.streams

    def block_inputs(self, layer: int, streams: mx.array, pre: mx.array, mixes):
        """A block's (streams, pre, mixes): the teacher's streams and `pre` for the block's
        rows where it gives them (then no handed-over mixes), else those given."""
        if not self.replaces_input(layer):
            return streams, pre, mixes
        rows = streams.shape[1]
        return (self.teacher.streams[layer][:, -rows:].astype(streams.dtype),
                self.teacher.pre[layer][:, -rows:].astype(mx.float32), None)


@dataclass
class ForwardState:
    """What one forward call over positions [start, end) shares across layers: its positions,
    each kv owner's shared state, the Engram rows and image mask of its rows, how the call
    reads the cache (a CED halo pass: precompressed owners, a truncated window), and its taps.
    `probe`: instrumentation, None in production."""

    start: int                                   # first position of this call
    end: int                                     # one past the last position
    shared: dict                                 # kv owner -> SharedKV
    engram_rows: Optional[mx.array] = None       # [B, S, n_engram_layers, columns]
    image_mask: Optional[mx.array] = None        # [B, end - start] bool: image-span positions
    precompressed: set = field(default_factory=set)  # owners whose compressor already ran
    truncate_window: bool = False                # bounded replay: no rows before the span
    compat_index_k_source: Optional[int] = None  # reference defect D1 switch (parity only)
    taps: Taps = field(default_factory=Taps)
    probe: Optional[Probe] = None

    def image_positions(self, rows: int) -> Optional[mx.array]:
        """The image mask of the call's last `rows` positions (None: no image in the call)."""
        return None if self.image_mask is None else self.image_mask[:, -rows:]

    @property
    def capturing(self) -> bool:
        return self.probe is not None and self.probe.capture is not None

    def record(self, name: str, value: mx.array) -> None:
        """Capture an intermediate (only with a probe that captures)."""
        if self.capturing:
            self.probe.capture[name] = value


def shared_state(cache: list, roles) -> dict:
    """A SharedKV for every kv owner of the cache (the readers find theirs by `kv_owner`)."""
    return {i: SharedKV(i, c.compressed) for i, c in enumerate(cache)
            if c.compressed is not None and roles[i].kv_owner == i}


@dataclass
class BatchState:
    """One forward over several sequences at once, each at its own position with its own
    cache (`model/batch.py`): every layer's dense work (projections, experts, mHC, norms, the
    head) runs over the rows of all of them, while attention reads and writes each sequence's
    own cache through its own `ForwardState` (`states[b]` for rows [b]). Quacks like a
    `ForwardState` where a block reads one."""

    states: list                                 # per sequence: its ForwardState
    engram_rows: Optional[mx.array] = None       # [B, n, n_engram_layers, columns]
    taps: Taps = field(default_factory=Taps)
    probe: Optional[Probe] = None                # always None: no instrumentation in a batch
    capturing: bool = False
    # (kv owner, selecting layer, sequences) -> [(sequences, their stacked selected packed
    # rows)]: gathered once per call for every layer that reads them (model/attention.py)
    selected: dict = field(default_factory=dict)

    def image_positions(self, rows: int) -> Optional[mx.array]:
        return None  # a batched forward carries no image rows (prompts prefill alone)

    def record(self, name: str, value: mx.array) -> None:
        pass
