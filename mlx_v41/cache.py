"""Per-layer inference state: the sliding-window ring, the owners' compressed KV and index keys,
the ratio-2 compressor's open group, and the Engram token history (spec cache.md §1–3).

`make_cache(model)` returns one `LayerCache` per backbone layer (mlx-lm's list convention).
Rows are held as their fake-quantised bf16 values; `offset` counts committed positions.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

GROW_STEP = 256  # rows added when a growing buffer fills


def _grow(buf: Optional[mx.array], needed: int, template: mx.array) -> mx.array:
    """Return a buffer of at least `needed` rows along axis 1, keeping `buf`'s contents."""
    have = 0 if buf is None else buf.shape[1]
    if have >= needed:
        return buf
    rows = ((needed + GROW_STEP - 1) // GROW_STEP) * GROW_STEP - have
    extra = mx.zeros((template.shape[0], rows) + template.shape[2:], dtype=template.dtype)
    return extra if buf is None else mx.concatenate([buf, extra], axis=1)


class WindowRing:
    """Fixed-capacity ring of window KV rows, slot = position mod capacity."""

    def __init__(self, window: int, capacity: Optional[int] = None):
        self.window = window
        self.capacity = capacity or window
        self.rows: Optional[mx.array] = None   # [B, capacity, D]

    def recent(self, offset: int) -> mx.array:
        """Rows of positions [offset - n, offset) in order, n = min(offset, window - 1)."""
        n = min(offset, self.window - 1)
        if n == 0 or self.rows is None:
            return None
        slots = mx.arange(offset - n, offset) % self.capacity
        return self.rows[:, slots]

    def write(self, rows: mx.array, offset: int) -> None:
        """Store rows of positions [offset, offset + S); only the last `capacity` matter."""
        if self.rows is None:
            shape = (rows.shape[0], self.capacity) + rows.shape[2:]
            self.rows = mx.zeros(shape, dtype=rows.dtype)
        keep = min(rows.shape[1], self.capacity)
        start = offset + rows.shape[1] - keep
        slots = mx.arange(start, start + keep) % self.capacity
        self.rows[:, slots] = rows[:, -keep:]

    @property
    def nbytes(self) -> int:
        return 0 if self.rows is None else self.rows.nbytes


class CompressedKV:
    """An owner layer's global cache: main KV rows, index-key rows and the open ratio-2 group."""

    def __init__(self, ratio: int):
        self.ratio = ratio
        self.count = 0
        self.kv: Optional[mx.array] = None        # [B, capacity, head_dim]
        self.index_k: Optional[mx.array] = None   # [B, capacity, index_head_dim]
        self.pending: Optional[tuple[mx.array, mx.array]] = None  # (k, score) [B, 1, D] fp32

    def append(self, kv_rows: mx.array, index_rows: mx.array) -> None:
        n = kv_rows.shape[1]
        if n == 0:
            return
        self.kv = _grow(self.kv, self.count + n, kv_rows)
        self.index_k = _grow(self.index_k, self.count + n, index_rows)
        self.kv[:, self.count:self.count + n] = kv_rows
        self.index_k[:, self.count:self.count + n] = index_rows
        self.count += n

    def keys(self) -> mx.array:
        return self.kv[:, :self.count]

    def index_keys(self, rows: Optional[int] = None) -> mx.array:
        return self.index_k[:, :self.count if rows is None else rows]

    @property
    def nbytes(self) -> int:
        total = sum(a.nbytes for a in (self.kv, self.index_k) if a is not None)
        return total + (sum(a.nbytes for a in self.pending) if self.pending else 0)


class LayerCache:
    """All state of one layer; `compressed` only for kv owners, `engram_history` for Engram
    layers (the last `max_ngram - 1` compressed ids, -1 = none)."""

    def __init__(self, window: int, ratio: int = 0, owns_kv: bool = False,
                 engram_history: int = 0):
        self.offset = 0
        self.window = WindowRing(window)
        self.compressed = CompressedKV(ratio) if owns_kv else None
        self.engram_history = np.full((1, engram_history), -1, np.int64) if engram_history \
            else None

    @property
    def nbytes(self) -> int:
        total = self.window.nbytes
        return total + (self.compressed.nbytes if self.compressed is not None else 0)
