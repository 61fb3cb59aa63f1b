"""Per-layer inference state in packed form.

* `WindowRing`: every layer's sliding-window KV, a fixed-capacity ring (slot = position mod R)
  of 528-byte FP8 rows (512 E4M3 values + 16 E8M0 scales); R = 2 x window so a
  multi-row call can be rolled back by resetting the length.
* `CompressedKV`: an owner layer's global cache, one packed FP4 main-KV row (288 B: E2M1 codes,
  even element in the low nibble, then E4M3 scales per 16) and one index-key row (68 B: codes,
  then E8M0 scales per 32) per compressed group, plus the ratio-2 compressor's open group and a
  ring of its recent inputs (for exact trimming).
* `LayerCache`: one layer's state, `offset`, `nbytes`, `state`, `trim` (mlx-lm's interface).
Decoding a row gives exactly the reference's fake-quantised values (tests/test_cache.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import mlx.core as mx
import numpy as np

from ..kernels.fp4_pack import fp4_pack
from ..kernels.swa_ring import swa_ring_update
from ..kernels.window_rows import recent_rows, window_rows
from ..numerics.quant import unpack_fp8_e8m0
from .stacked import (Stackable, holding, is_held, is_shared, share, stack_padded, stacked,
                      unshare)

GROW_STEP = 256  # rows added when a compressed cache fills
ENGRAM_KEPT = 512  # Engram ids kept: > the most a trim can undo (one ring) + the n-gram history
RING_FACTOR = 2  # ring capacity in windows: the spare half holds rows a rollback may restore


def rollback_limit(window: int) -> int:
    """Most tokens a trim can undo: the ring holds RING_FACTOR windows and the new end still
    needs the window - 1 rows before it."""
    return RING_FACTOR * window - window + 1


class CacheError(ValueError):
    """A cache operation that cannot be done exactly (the message says why)."""


def _put_rows(buf: mx.array, slots: mx.array, rows: mx.array) -> mx.array:
    """A new buffer with `rows` [B, n, ...] at axis-1 `slots` (functional: snapshots that share
    the old buffer stay unchanged)."""
    idx = slots.reshape((1, -1) + (1,) * (rows.ndim - 2))
    return mx.put_along_axis(buf, idx, rows, axis=1)


def _grow(buf: Optional[mx.array], needed: int, batch: int, width: int, dtype) -> mx.array:
    """A buffer [B, >= needed, width] keeping `buf`'s rows; grows in GROW_STEP pages."""
    have = 0 if buf is None else buf.shape[1]
    if have >= needed:
        return buf
    rows = -(-needed // GROW_STEP) * GROW_STEP - have
    extra = mx.zeros((batch, rows, width), dtype=dtype)
    return extra if buf is None else mx.concatenate([buf, extra], axis=1)


class WindowRing:
    """Window KV rows of positions [valid_from, end) in slots position mod capacity. In a batch
    step the rows may be a row of the rings of every sequence stacked (`cache/stacked.py`)."""

    rows = Stackable()  # [B, capacity, 33 * D / 32] uint8, or None while nothing is written

    def __init__(self, window: int, capacity: Optional[int] = None):
        self.window = window
        self.capacity = capacity or RING_FACTOR * window
        self.rows = None
        self.valid_from = 0
        self.end = 0

    def recent(self, position: int) -> Optional[mx.array]:
        """Decoded rows of positions [position - n, position), n = min(position, window - 1)."""
        n = self._held_before(position)
        return None if n == 0 else recent_rows(self.rows, position, n)

    def with_recent(self, values: mx.array, position: int, keep: int) -> mx.array:
        """The last `keep` rows of `recent(position)` followed by `values` [B, S, d] (bf16
        window KV of positions [position, position + S)): the window an attention call reads
        (one Metal launch where its kernel applies, kernels/window_rows.py)."""
        n = self._held_before(position)
        return window_rows(self.rows, values, position, n, max(0, n + values.shape[1] - keep))

    def _held_before(self, position: int) -> int:
        """How many rows before `position` a window reads from the ring (0: none held)."""
        return min(position, self.window - 1) if self.allocated else 0

    def rows_at(self, positions: mx.array) -> mx.array:
        """Decoded rows [B, n, d] of the given held positions, in the given order."""
        return unpack_fp8_e8m0(mx.take(self.rows, positions % self.capacity, axis=1))

    def write(self, values: mx.array, position: int) -> None:
        """Store window KV values of positions [position, position + S) as FP8 rows."""
        if not self.allocated:
            width = values.shape[-1] + values.shape[-1] // 32
            self.rows = mx.zeros((values.shape[0], self.capacity, width), mx.uint8)
        self.took(swa_ring_update(self.rows, values, position), position, values.shape[1])

    def took(self, rows: mx.array, position: int, length: int) -> None:
        """`rows` are now the ring, after positions [position, position + length) were
        written into it (by `write`, or by one update of several stacked rings)."""
        self.rows = rows
        self.advanced(position, length)

    def advanced(self, position: int, length: int) -> None:
        """Positions [position, position + length) are now in the rows."""
        end = position + length
        if position > self.end:  # rows in between were never computed (CED prefill)
            self.valid_from = position
        self.valid_from = max(self.valid_from, end - self.capacity)
        self.end = end

    def rewind(self, position: int) -> None:
        self.end = position

    @property
    def allocated(self) -> bool:
        return is_held(self, "rows")

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes if self.allocated else 0


class CompressedKV:
    """An owner layer's packed global cache: row j = compressed group j. In a batch the rows
    of the decoding sequences stay stacked, padded to one capacity (`append_stacked`)."""

    kv = Stackable()       # [B, capacity, 288-style] uint8, or None before the first row
    index_k = Stackable()  # [B, capacity, 68-style] uint8

    # Ring of recent compressor inputs (k, score) [B, history, 2, d] fp32, slot = position mod
    # history: what a trim to an odd length needs to reopen a group (stackable in a batch).
    inputs = Stackable()

    def __init__(self, ratio: int, history: int = 0):
        self.ratio = ratio
        self.count = 0
        self.kv = self.index_k = None
        self._pending = None  # `pending`: a tuple, or the slot of the input ring holding it
        self.history = history
        self.inputs = None

    @property
    def pending(self) -> Optional[tuple[mx.array, mx.array]]:
        """The open group (k, score) [B, 1, d] fp32, or None. Where its token is the input
        ring's row at a slot (after a batch step or a rewind, `open_at`), it is read from the
        ring: a batch's open groups then stay in their stacked ring, copied out by no one."""
        if isinstance(self._pending, int):
            rows, slot = self.inputs, self._pending
            return rows[:, slot:slot + 1, 0], rows[:, slot:slot + 1, 1]
        return self._pending

    @pending.setter
    def pending(self, value: Optional[tuple[mx.array, mx.array]]) -> None:
        self._pending = value

    def open_at(self, slot: int) -> None:
        """The open group is the one token in the input ring's `slot`."""
        self._pending = slot

    def append(self, kv_values: mx.array, index_values: mx.array) -> None:
        """Pack and store new rows (their values are already RoPE'd)."""
        n = kv_values.shape[1]
        if n == 0:
            return
        kv = fp4_pack(kv_values, "kv")
        ik = fp4_pack(index_values, "index")
        self.append_packed(kv, ik)

    def append_packed(self, kv: mx.array, ik: mx.array) -> None:
        """Store rows already packed ([B, n, bytes] uint8: another rank's, in a pipeline)."""
        n, batch = kv.shape[1], kv.shape[0]
        self.kv = _grow(self.kv, self.count + n, batch, kv.shape[-1], mx.uint8)
        self.index_k = _grow(self.index_k, self.count + n, batch, ik.shape[-1], mx.uint8)
        start = mx.array([0, self.count, 0])
        self.kv = mx.slice_update(self.kv, kv, start, axes=(0, 1, 2))
        self.index_k = mx.slice_update(self.index_k, ik, start, axes=(0, 1, 2))
        self.count += n

    def remember_inputs(self, k: mx.array, s: mx.array, position: int) -> None:
        """Keep the compressor inputs of positions [position, position + S) in the ring."""
        if not self.history:
            return
        rows = mx.stack([k, s], axis=2)
        if self.inputs is None:
            self.inputs = mx.zeros((rows.shape[0], self.history) + rows.shape[2:], mx.float32)
        keep = min(rows.shape[1], self.history)
        start = position + rows.shape[1] - keep
        self.inputs = _put_rows(self.inputs, mx.arange(start, start + keep) % self.history,
                                rows[:, -keep:])

    def packed_rows(self) -> mx.array:
        """Packed main-KV rows [B, count, bytes]; attention decodes only what it selects."""
        return self.kv[:, :self.count]

    def packed_index_keys(self, rows: Optional[int] = None) -> mx.array:
        """Packed index-key rows [B, rows, bytes] of rows [0, rows) (all rows by default); the
        indexer decodes them block by block."""
        return self.index_k[:, :self.count if rows is None else rows]

    def rewind(self, position: int) -> None:
        """Drop the rows and open group after `position` tokens."""
        self.count = min(self.count, position // self.ratio)
        self.pending = None
        if self.ratio > 1 and position % self.ratio:
            self.open_at((position - 1) % self.history)

    @property
    def nbytes(self) -> int:
        """Bytes of the committed rows (the length-dependent global KV)."""
        if self.kv is None:
            return 0
        batch = self.kv.shape[0]
        return batch * self.count * (self.kv.shape[-1] + self.index_k.shape[-1])

    @property
    def fixed_nbytes(self) -> int:
        """Open group and input ring (bounded)."""
        ring = 0 if self.inputs is None else self.inputs.nbytes
        if isinstance(self._pending, tuple):
            return ring + sum(a.nbytes for a in self._pending)
        # an open group in a ring slot counts as one too: the bytes the same cache has alone
        return ring + (0 if self._pending is None else ring // self.history)


class LayerCache:
    """All state of one layer. `offset` is the one committed position: a forward advances the
    rings, compressed rows and Engram ids as it runs, and `commit` sets `offset` when the call
    succeeded (`transaction` puts everything back when it did not). `compressed` only for kv
    owners; `engram_ids` (compressed token ids of the last ENGRAM_KEPT positions, [B, <=
    ENGRAM_KEPT] int32 numpy) only for Engram layers: hashing needs 3, a trim at most a ring's
    worth. `trim_budget` is the rollback the whole model cache allows (set by `commit`, the same
    in every layer), so per-layer trims by mlx-lm's helpers stay consistent."""

    engram_ids = Stackable()  # a row of the batch's histories while they stay stacked

    def __init__(self, window: int, ratio: int = 0, owns_kv: bool = False,
                 has_engram: bool = False):
        self.offset = 0
        self.trim_budget = 0
        self.window = WindowRing(window)
        history = self.window.capacity if ratio > 1 else 0
        self.compressed = CompressedKV(ratio, history) if owns_kv else None
        self.engram_ids = np.zeros((1, 0), np.int32) if has_engram else None

    @property
    def batch(self) -> Optional[int]:
        """Rows of the batch this cache holds (None while empty; 1 as a row of a batch's)."""
        if is_shared(self.window, "rows"):
            return 1
        return self.window.rows.shape[0] if self.window.allocated else None

    def is_trimmable(self) -> bool:
        return True

    def exact_limit(self) -> int:
        """Most tokens this layer alone can undo exactly: all of them while its ring still holds
        every position it saw, else back to where the ring still holds the window."""
        if self.window.valid_from == 0:
            return self.offset
        return max(0, self.offset - self.window.window + 1 - self.window.valid_from)

    def max_trim(self) -> int:
        """Most tokens `trim` undoes (the model cache's budget, see `commit`)."""
        return min(self.trim_budget, self.offset)

    def trim(self, n: int) -> int:
        """Forget the last min(n, max_trim()) positions and return how many (mlx-lm's
        contract: trim what can be trimmed exactly, report the count)."""
        if not isinstance(n, (int, np.integer)) or n < 0:
            raise CacheError(f"trim needs a token count >= 0, got {n!r}")
        n = min(int(n), self.max_trim())
        if n == 0:
            return 0
        position = self.offset - n
        self.window.rewind(position)
        if self.compressed is not None:
            self.compressed.rewind(position)
        if self.engram_ids is not None:
            self.engram_ids = self.engram_ids[:, :max(0, self.engram_ids.shape[1] - n)]
        self.offset = position
        self.trim_budget -= n
        return n

    def snapshot(self) -> tuple:
        """The layer's state (arrays are immutable, so references suffice) for `restore`."""
        kv = None if self.compressed is None else dict(vars(self.compressed))
        return dict(vars(self)), dict(vars(self.window)), kv

    def restore(self, saved: tuple) -> None:
        mine, window, kv = saved
        vars(self).update(mine)
        vars(self.window).update(window)
        if kv is not None:
            vars(self.compressed).update(kv)

    def check(self, layer: int) -> None:
        """Every record of the position agrees with `offset` (CacheError naming the field)."""
        def fail(what, value):
            raise CacheError(f"layer {layer}: {what} is {value} but the cache offset is "
                             f"{self.offset}")
        if self.window.end != self.offset:
            fail("the window ring's end", self.window.end)
        kv = self.compressed
        if kv is not None and kv.count != self.offset // kv.ratio:
            fail(f"the compressed row count (ratio {kv.ratio})", kv.count)
        if kv is not None and kv.ratio > 1 and (kv.pending is not None) != bool(
                self.offset % kv.ratio):
            fail("the open compressor group", "present" if kv.pending else "absent")
        if self.engram_ids is not None and self.engram_ids.shape[1] > self.offset:
            fail("the Engram id history length", self.engram_ids.shape[1])

    @property
    def state(self) -> list:
        """The layer's arrays (mlx-lm's convention: `mx.eval([c.state for c in cache])` after a
        prefill chunk materialises the cache and frees the graph that produced it)."""
        arrays = [self.window.rows]
        if isinstance(self.engram_ids, mx.array):
            arrays.append(self.engram_ids)
        if self.compressed is not None:
            kv = self.compressed
            arrays += [kv.kv, kv.index_k, kv.inputs] + (list(kv.pending) if kv.pending else [])
        return [a for a in arrays if a is not None]

    @property
    def nbytes(self) -> int:
        total = self.window.nbytes
        if self.compressed is not None:
            total += self.compressed.nbytes + self.compressed.fixed_nbytes
        if self.engram_ids is not None:
            total += self.engram_ids.nbytes
        return total


@contextmanager
def transaction(cache: list):
    """Run a forward over `cache`: on any exception (Ctrl-C included) every layer is put back
    exactly as it was, so a failed call never leaves a half-advanced cache."""
    saved = [c.snapshot() for c in cache]
    try:
        yield
    except BaseException:
        for c, s in zip(cache, saved):
            c.restore(s)
        raise


def commit(cache: list, end: int) -> None:
    """End a successful call: `end` becomes every layer's offset, the shared trim budget is the
    smallest exact rollback over the layers, and every layer is checked against it."""
    for c in cache:
        c.offset = end
    refresh_trim_budget(cache)
    for i, c in enumerate(cache):
        c.check(i)


def refresh_trim_budget(cache: list) -> None:
    """Give every layer the model cache's exact rollback (after a commit or a load)."""
    budget = min(c.exact_limit() for c in cache) if cache else 0
    for c in cache:
        c.trim_budget = budget


def trim_cache(cache: list, n: int) -> int:
    """Trim every layer by `n` tokens, or none if the cache cannot (then it is unchanged)."""
    limit = min(c.max_trim() for c in cache)
    if not isinstance(n, (int, np.integer)) or not 0 <= n <= limit:
        raise CacheError(f"cannot trim {n} tokens from this cache: it holds {cache[0].offset} "
                         f"positions and can roll back at most {limit} exactly")
    for c in cache:
        c.trim(n)
    return n


def stacked_packed(stores: list, name: str, width: int) -> mx.array:
    """The stores' packed rows (`name`: "kv" or "index_k", `width` bytes each) [G, T, width],
    T >= every count: the array they share when they are its rows in order (no launch), else
    their arrays stacked, padded with zeros to the largest (one concatenation and one gather;
    a store without rows has none). Rows past a store's count are not its own."""
    if all(is_held(s, name) for s in stores):
        return stacked(stores, name, padded=True)
    return stack_padded([getattr(s, name) if is_held(s, name)
                         else mx.zeros((1, 0, width), mx.uint8) for s in stores])


def append_stacked(stores: list, members: list, kv: mx.array, ik: mx.array) -> None:
    """`append_packed` of kv / ik [M, n, bytes] to stores[members[m]], M of the G stores of a
    batch step, at once: the G stores' rows become (or stay) rows of arrays they share, padded
    to one capacity (GROW_STEP pages), and each array takes every new row in one scatter."""
    n = kv.shape[1]
    counts = np.asarray([stores[g].count for g in members])
    needed = max(s.count for s in stores) + n
    for name, rows in (("kv", kv), ("index_k", ik)):
        pool = _grow(stacked_packed(stores, name, rows.shape[-1]), needed, len(stores),
                     rows.shape[-1], mx.uint8)
        share(stores, name, _put_flat(pool, np.asarray(members), counts, rows))
    for g in members:
        stores[g].count += n


def _put_flat(pool: mx.array, members: np.ndarray, counts: np.ndarray,
              rows: mx.array) -> mx.array:
    """`pool` [G, T, w] with rows [M, n, w] at rows counts[m].. of batch row members[m]
    (one scatter; the index is made on the host)."""
    batch, total, width = pool.shape
    m, n, _ = rows.shape
    flat = (members[:, None] * total + counts[:, None] + np.arange(n)).reshape(-1)
    index = mx.broadcast_to(mx.array(flat.astype(np.int32))[:, None], (m * n, width))
    out = mx.put_along_axis(pool.reshape(batch * total, width), index,
                            rows.reshape(m * n, width), axis=0)
    return out.reshape(batch, total, width)


def unshare_cache(cache: list) -> None:
    """Give every layer its own rings and rows again (a sequence leaving a batch): one gather
    per array that is a row of the batch's stacked arrays, and of its open compressor group
    (a view of the batch's rows), so the finished cache keeps only its own (its compressed
    rows cut to its own GROW_STEP pages). Layers that hold the same Engram history get the
    same copy."""
    copies: dict = {}  # Engram histories copied, by what they held (the holders stay alive)
    for c in cache:
        unshare(c.window, "rows")
        if isinstance(c.engram_ids, mx.array):  # a row of the batch's, or a trim's slice of it
            key = holding(c, "engram_ids")
            if key not in copies:
                copies[key] = mx.take(c.engram_ids, mx.array([0]), axis=0)
            c.engram_ids = copies[key]
        kv = c.compressed
        if kv is not None:
            unshare(kv, "inputs")
            pages = -(-max(kv.count, 1) // GROW_STEP) * GROW_STEP
            unshare(kv, "kv", pages)
            unshare(kv, "index_k", pages)
            if isinstance(kv._pending, tuple):  # may be a view of the batch's rows: copied
                kv.pending = tuple(mx.take(p, mx.array([0]), axis=0) for p in kv.pending)
            # (a ring slot reads the ring unshared above)


def cache_bytes(cache: list) -> dict:
    """Measured bytes of a model cache: `global_kv` (compressed KV + index keys: the
    length-dependent part), `window` (the constant rings) and `other` (open groups, compressor
    input rings, Engram id history)."""
    global_kv = sum(c.compressed.nbytes for c in cache if c.compressed is not None)
    window = sum(c.window.nbytes for c in cache)
    total = sum(c.nbytes for c in cache)
    return {"global_kv": global_kv, "window": window, "other": total - global_kv - window,
            "total": total}
