"""Sliding-window (SWA) ring update: FP8-round a chunk's window KV rows (act_fp8, official
inference/model.py L706–707) and write them at slots `position mod R` of the layer's ring. The
ring holds either the rounded values ([B, R, D] float) or packed rows ([B, R, D + D/32] uint8:
E4M3 codes, then E8M0 scale bytes; 528 B for D = 512).

The position of a chunk's first row is one int for every batch row, or one per batch row
(sequences at different positions in one batch). The Metal kernel (metal/swa_ring.metal) fuses
the rounding (or packing) and the slot writes of every batch row into one launch.
`mx.fast.metal_kernel` outputs are fresh buffers, so it re-emits the whole ring; the ops path
scatters the rows and lets MLX reuse the ring's buffer when nothing else holds it.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from ..numerics.fp8_activation import act_fp8_qdq, pack_fp8_e8m0
from ..numerics.quant import ACT_FP8_BLOCK
from .builder import simd_threadgroup
from .check import assert_equal
from .spec import KernelSpec

_FLOAT_DTYPES = (mx.bfloat16, mx.float16, mx.float32)


def row_positions(name: str, positions, batch: int) -> Optional[tuple]:
    """None for one int position shared by every batch row; else the B ints of a per-row
    position (a tuple or list of ints, or an int32/int64 mx.array [B] or [B, 1], the form
    `rope_products` takes), checked: one per row, each in [0, 2^31). A bad one raises a
    one-line ValueError naming `name` and the problem."""
    if isinstance(positions, mx.array) and positions.ndim == 0:
        positions = positions.item()
    if isinstance(positions, (int, np.integer)):
        return None
    if isinstance(positions, mx.array):
        if positions.ndim == 2 and positions.shape[1] == 1:
            positions = positions.reshape(-1)
        if positions.ndim != 1 or positions.dtype not in (mx.int32, mx.int64):
            raise ValueError(f"{name}: per-row positions must be an int32 or int64 array [B] "
                             f"or [B, 1], got {positions.dtype} of shape "
                             f"{tuple(positions.shape)}")
        positions = positions.tolist()
    if not isinstance(positions, (tuple, list)) or not all(
            isinstance(p, (int, np.integer)) and not isinstance(p, bool) for p in positions):
        raise ValueError(f"{name}: a position is an int or one int per batch row, got "
                         f"{type(positions).__name__}")
    if len(positions) != batch:
        raise ValueError(f"{name}: {len(positions)} positions for {batch} batch rows")
    for row, position in enumerate(positions):
        if not 0 <= position < 2 ** 31:
            raise ValueError(f"{name}: position {position} of row {row} is out of [0, 2^31)")
    return tuple(int(p) for p in positions)


def position_buffer(positions, batch: int) -> mx.array:
    """The int32 [B] position of each batch row a kernel reads (an int: the same for all),
    made on the host (an int32 array [B] as given)."""
    if isinstance(positions, mx.array) and positions.ndim == 1:
        return positions if positions.dtype == mx.int32 else positions.astype(mx.int32)
    if isinstance(positions, (tuple, list)):
        return mx.array(np.asarray(positions, np.int64).astype(np.int32))
    return mx.array(np.full(batch, int(positions), np.int32))


def is_packed_ring(ring: mx.array, width: int) -> bool:
    """A uint8 ring of D + D/32 byte rows holds packed FP8 rows; otherwise rounded values."""
    if ring.dtype != mx.uint8:
        return False
    if ring.shape[-1] != width + width // ACT_FP8_BLOCK:
        raise ValueError(f"a packed ring for width {width} needs rows of "
                         f"{width + width // ACT_FP8_BLOCK} bytes, got {ring.shape[-1]}")
    return True


def swa_ring_update_ops(ring: mx.array, rows: mx.array, offset) -> mx.array:
    """Reference: ring [B, R, D] float or [B, R, D + D/32] uint8, rows [B, S, D] of positions
    offset .. offset + S - 1 -> the new ring (pure MLX). `offset` an int, or one per batch
    row (B ints, or an int array [B] or [B, 1]): row b the bytes of a batch-1 call at
    offset[b]. When S > R only the last R rows land."""
    length, capacity = rows.shape[1], ring.shape[1]
    if length == 0:
        return ring
    if isinstance(offset, mx.array):
        offset = offset.tolist()
    keep = min(length, capacity)
    first = np.asarray(offset, np.int64).reshape(-1, 1) + (length - keep)  # [1 or B, 1]
    slots = mx.array(((first + np.arange(keep)) % capacity).astype(np.int32))  # host: no ops
    kept = rows[:, length - keep:] if keep < length else rows
    if is_packed_ring(ring, rows.shape[-1]):
        values = pack_fp8_e8m0(kept)
    else:
        values = act_fp8_qdq(kept).astype(ring.dtype)
    return mx.put_along_axis(ring, mx.broadcast_to(slots[..., None], values.shape), values,
                             axis=1)


def _launch(kernel, ring: mx.array, rows: mx.array, offset) -> mx.array:
    threads = ring.shape[0] * ring.shape[1] * rows.shape[-1]
    packed = is_packed_ring(ring, rows.shape[-1])
    out, = kernel(inputs=[ring, rows, position_buffer(offset, ring.shape[0])],
                  template=[("T", ring.dtype), ("PACKED", packed)],
                  grid=(threads, 1, 1), threadgroup=(simd_threadgroup(threads), 1, 1),
                  output_shapes=[ring.shape], output_dtypes=[ring.dtype])
    return out


def _probe(run, ops) -> None:
    """Three rows written across the end of a packed ring of 8, then two batch rows at their
    own positions (row 0's across the end, row 1's not): bytes equal to the ops'."""
    ring = (mx.arange(2 * 8 * 66, dtype=mx.uint32) % 251).astype(mx.uint8).reshape(2, 8, 66)
    rows = (mx.cos(mx.arange(2 * 3 * 64, dtype=mx.float32) * 0.21) * 5).reshape(2, 3, 64)
    rows = rows.astype(mx.bfloat16)
    assert_equal("swa_ring_update", run(ring[:1], rows[:1], 6), ops(ring[:1], rows[:1], 6))
    assert_equal("swa_ring_update", run(ring, rows, (6, 17)), ops(ring, rows, (6, 17)))


# The kernel as `run(ring, rows, offset)` (offset an int, or one per batch row):
# metal/swa_ring.metal, rounding (or packing) and the slot writes in one launch; it reads each
# batch row's first position from the int32 [B] buffer `positions`.
SWA_RING_UPDATE = KernelSpec("v41_swa_ring_update", "swa_ring_update",
                             ("ring", "rows", "positions"),
                             ("out",), "swa_ring.metal", _launch, _probe, swa_ring_update_ops,
                             headers=("v41_common.h",))


def swa_ring_update(ring: mx.array, rows: mx.array, offset, use_kernel: Optional[bool] = None,
                    run=None) -> mx.array:
    """Write a chunk's window rows into the ring, FP8-rounded.

    Args:
        ring: [B, R, D] rounded values, or [B, R, D + D/32] uint8 packed FP8 rows (slot =
            position mod R).
        rows: [B, S, D] window KV rows of positions offset .. offset + S - 1 (rounded or not:
            act_fp8 is idempotent on the values), D a multiple of 32; when S > R only the
            last R rows are kept.
        offset: absolute position of rows[:, 0] (>= 0), an int; or per batch row, a tuple or
            list of B ints or an int32/int64 array [B]: row b's rows are of positions
            offset[b] .. offset[b] + S - 1 (one launch for all rows; row b the bytes of a
            batch-1 call at offset[b]).
        use_kernel: use the Metal kernel when it applies.
        run: an already built kernel (`SWA_RING_UPDATE.build(factory)`) to use unconditionally,
            e.g. the Metal simulator's in tests.
    Returns:
        The new ring, same shape and dtype; the kept rows' slots hold act_fp8_qdq(rows) or
        pack_fp8_e8m0(rows).
    """
    per_row = row_positions("swa_ring_update", offset, rows.shape[0])
    if per_row is not None and ring.shape[0] != rows.shape[0]:
        raise ValueError(f"swa_ring_update: a ring of {ring.shape[0]} batch rows for rows of "
                         f"{rows.shape[0]}")
    if per_row is None:
        offset = int(offset)
    packed = is_packed_ring(ring, rows.shape[-1])
    run = SWA_RING_UPDATE.choose(use_kernel, run, applies=(
        rows.shape[1] > 0 and rows.dtype in _FLOAT_DTYPES and (packed or ring.dtype == rows.dtype)
        and rows.shape[-1] % ACT_FP8_BLOCK == 0 and (per_row is not None or offset >= 0)))
    offset = offset if per_row is None else per_row
    return swa_ring_update_ops(ring, rows, offset) if run is None else run(ring, rows, offset)
