"""Engram: hashed n-gram memory added into all residual copies before its layers (official
inference/engram.py). Table rows stay FP8 with one E8M0 scale per 32 values, memory-mapped from
disk (the published tables are ~100 GB each), and only the rows a token looks up are read and
dequantised; a gate per copy decides how much of the shared value to add.
"""

from __future__ import annotations

import mmap
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..cache import layer as cache_layer
from ..cache.stacked import share, stacked_right
from .layers import QuantLinear
from ..numerics.quant import e4m3_to_float, e8m0_to_float
from ..errors import CheckpointError
from ..kernels.context import settle

GATE_FLOOR = 1e-6  # clamp on |dot| before the signed square root
ROW_GROUP = 32  # values per E8M0 scale within a row


class EngramRows:
    """A table on disk, never copied into memory: consecutive parts of rows, each a pair of
    read-only numpy views into memory-mapped files, E4M3 codes `[r, dim]` and E8M0 scales
    `[r, dim / 32]` (two tensors of a published shard, or two column ranges of the
    converter's packed rows). A lookup reads only the pages of the rows it asks for."""

    def __init__(self, parts: list):
        self.parts = parts
        self.starts = np.cumsum([0] + [codes.shape[0] for codes, _ in parts])
        self.rows = int(self.starts[-1])
        self.head_dim = parts[0][0].shape[1]
        self.nbytes = sum(codes.nbytes + scales.nbytes for codes, scales in parts)

    @classmethod
    def from_regions(cls, regions: list) -> "EngramRows":
        """regions: per part ((path, byte offset, [r, dim]) of the codes, (...) of the scales)."""
        maps, parts = {}, []
        for region in regions:
            views = []
            for path, offset, shape in region:
                if path not in maps:
                    maps[path] = map_file(path)
                count = int(np.prod(shape))
                views.append(np.frombuffer(maps[path], np.uint8, count, offset).reshape(shape))
            parts.append(tuple(views))
        return cls(parts)

    @classmethod
    def from_packed(cls, files: list) -> "EngramRows":
        """files: (path, byte offset, rows, dim) of packed rows, `dim` codes then `dim / 32`
        scales per row (the converter's layout)."""
        parts = []
        for path, offset, rows, dim in files:
            width = dim + dim // ROW_GROUP
            packed = np.frombuffer(map_file(path), np.uint8, rows * width, offset)
            packed = packed.reshape(rows, width)
            parts.append((packed[:, :dim], packed[:, dim:]))
        return cls(parts)

    def gather(self, ids: np.ndarray) -> tuple:
        """ids [...] -> (codes [..., dim], scales [..., dim / 32]) uint8, rows read on demand."""
        flat = np.asarray(ids, dtype=np.int64).reshape(-1)
        if flat.size and (flat.min() < 0 or flat.max() >= self.rows):
            raise IndexError(f"Engram row id outside 0..{self.rows - 1}")
        if len(self.parts) == 1:
            codes, scales = self.parts[0][0][flat], self.parts[0][1][flat]
        else:
            codes = np.empty((flat.size, self.head_dim), np.uint8)
            scales = np.empty((flat.size, self.head_dim // ROW_GROUP), np.uint8)
            which = np.searchsorted(self.starts, flat, side="right") - 1
            for p in np.unique(which):
                hit = which == p
                local = flat[hit] - self.starts[p]
                codes[hit], scales[hit] = self.parts[p][0][local], self.parts[p][1][local]
        shape = tuple(np.shape(ids))
        return codes.reshape(*shape, -1), scales.reshape(*shape, -1)


def map_file(path) -> mmap.mmap:
    """Read-only map of a whole file, advised for random access (no readahead per row)."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mapped, "madvise") and hasattr(mmap, "MADV_RANDOM"):
        mapped.madvise(mmap.MADV_RANDOM)
    return mapped


class EngramTable(nn.Module):
    """FP8 E4M3 rows `[rows, head_dim]` with E8M0 scales `[rows, head_dim / 32]`, held on disk
    (`EngramRows`, attached by the loader) rather than as parameters."""

    def __init__(self, rows: int, head_dim: int):
        super().__init__()
        self.rows, self.head_dim = rows, head_dim
        self.storage = None

    @property
    def nbytes(self) -> int:
        return self.rows * (self.head_dim + self.head_dim // ROW_GROUP)

    def attach(self, storage: EngramRows) -> None:
        if (storage.rows, storage.head_dim) != (self.rows, self.head_dim):
            raise CheckpointError(f"Engram table has {storage.rows} rows of {storage.head_dim},"
                                  f" expected {self.rows} rows of {self.head_dim}")
        self.storage = storage

    def __call__(self, ids: mx.array) -> mx.array:
        """ids [...] -> dequantised rows [..., head_dim] bf16."""
        if self.storage is None:
            raise RuntimeError("Engram table not loaded; use mlx_v41.load_model(path)")
        codes, scale_bytes = self.storage.gather(np.array(ids))
        values = e4m3_to_float(mx.array(codes))
        scales = e8m0_to_float(mx.array(scale_bytes))
        values = values.reshape(*values.shape[:-1], scales.shape[-1], -1) * scales[..., None]
        return values.reshape(*ids.shape, -1).astype(mx.bfloat16)


class Engram(nn.Module):
    def __init__(self, hidden: int, hc_mult: int, rows: int, n_columns: int, head_dim: int,
                 eps: float):
        super().__init__()
        self.embed = EngramTable(rows, head_dim)
        self.kv_proj = QuantLinear(n_columns * head_dim, hidden * (hc_mult + 1))
        self.q_weight = mx.zeros((hc_mult, hidden), dtype=mx.bfloat16)
        self.k_weight = mx.zeros((hc_mult, hidden), dtype=mx.bfloat16)
        self.hc_mult, self.hidden, self.eps = hc_mult, hidden, eps

    def __call__(self, streams: mx.array, row_ids: mx.array,
                 image_mask: Optional[mx.array] = None) -> mx.array:
        """streams [B, S, n, D] bf16, row_ids [B, S, columns] -> updated streams; the gate is 0
        where `image_mask` [B, S] is True (image-span positions)."""
        batch, length, n, dim = streams.shape
        memory = self.embed(row_ids).reshape(batch, length, -1)
        # where evaluations are kept short, the projection (a prompt piece's longest operation)
        # in an evaluation of its own, not queued among the gate's operations
        settle(memory)
        kv = self.kv_proj(memory).astype(mx.float32)
        settle(kv)
        key = kv[..., :n * dim].reshape(batch, length, n, dim)
        value = kv[..., n * dim:]
        weight = self.q_weight.astype(mx.float32) * self.k_weight.astype(mx.float32)
        h = streams.astype(mx.float32)
        rho = mx.rsqrt(mx.mean(h * h, axis=-1) + self.eps) * \
            mx.rsqrt(mx.mean(key * key, axis=-1) + self.eps)
        dot = mx.sum(h * weight * key, axis=-1) * rho / (dim ** 0.5)
        negative = (dot.view(mx.uint32) >> 31) == 1       # copysign keeps the sign of -0.0
        root = mx.sqrt(mx.maximum(mx.abs(dot), GATE_FLOOR))
        gate = mx.sigmoid(mx.where(negative, -root, root))
        if image_mask is not None:
            gate = mx.where(image_mask[..., None], 0.0, gate)
        return (h + gate[..., None] * value[:, :, None, :]).astype(streams.dtype)


def engram_rows(hasher, layers: list, ids: mx.array, cache: list,
                image_mask: Optional[mx.array] = None) -> Optional[mx.array]:
    """Engram table rows [B, S, n_layers, columns] of a chunk of `ids` [B, S], hashed lazily
    (no host sync) with the cache's compressed-id history; the chunk's ids join that history,
    image-span positions (`image_mask` [B, S]) as DEAD, so no n-gram reaches across them."""
    if not layers:
        return None
    if hasher is None:
        raise RuntimeError("this model has Engram layers but no token map was loaded; "
                           "use mlx_v41.load_model(path)")
    batch = ids.shape[0]
    seen = cache[layers[0]].engram_ids
    if seen.shape[1] and seen.shape[0] != batch:
        raise ValueError(f"ids have batch {batch} but the cache's Engram history holds batch "
                         f"{seen.shape[0]}")
    seen = mx.array(seen) if seen.shape[1] else mx.zeros((batch, 0), mx.int32)
    rows, compressed = hasher.hash_lazy(ids, seen, image_mask)
    _keep_history(cache, layers, seen, compressed)
    return rows


def _keep_history(cache: list, layers: list, seen: mx.array, compressed: mx.array) -> None:
    """The chunk's compressed ids join the history of every Engram layer. Only the recent ids
    are kept: a full history would be copied on every token."""
    kept = mx.concatenate([seen, compressed], axis=1)[:, -cache_layer.ENGRAM_KEPT:]
    for layer in layers:
        cache[layer].engram_ids = kept


def engram_rows_stacked(hasher, layers: list, ids: mx.array,
                        caches: list) -> Optional[mx.array]:
    """`engram_rows` of B sequences (row b of `ids` [B, S] continues `caches[b]`) in one hash:
    a row's hash reads only the last `history_length` ids before it, so where every sequence
    has that many their histories are stacked, right-aligned (`stacked_right`); otherwise
    sequence by sequence. The histories are kept as rows of one array, each its own length,
    which the next step takes as it is (`cache.stacked`): one concatenation per step, not one
    per sequence."""
    if not layers or hasher is None or len(caches) == 1:
        return _rows_one_by_one(hasher, layers, ids, caches)
    depth = hasher.history_length
    holders = [cache[layers[0]] for cache in caches]
    seen = [h.engram_ids for h in holders]
    if depth == 0 or any(s.shape[0] != 1 or s.shape[1] < depth for s in seen):
        return _rows_one_by_one(hasher, layers, ids, caches)
    history, lengths = stacked_right([_as_array(h) for h in holders], "engram_ids")
    rows, compressed = hasher.hash_lazy(ids, history[:, -depth:])
    kept = mx.concatenate([history, compressed], axis=1)[:, -cache_layer.ENGRAM_KEPT:]
    lengths = [min(n + compressed.shape[1], kept.shape[1]) for n in lengths]
    for layer in layers:
        share([cache[layer] for cache in caches], "engram_ids", kept, lengths)
    return rows


def _as_array(holder):
    """The holder, its Engram history an `mx.array` (a loaded or fresh cache holds numpy)."""
    if isinstance(holder.engram_ids, np.ndarray):
        holder.engram_ids = mx.array(holder.engram_ids)
    return holder


def _rows_one_by_one(hasher, layers: list, ids: mx.array, caches: list) -> Optional[mx.array]:
    rows = [engram_rows(hasher, layers, ids[b:b + 1], cache) for b, cache in enumerate(caches)]
    return None if rows[0] is None else mx.concatenate(rows, axis=0)
