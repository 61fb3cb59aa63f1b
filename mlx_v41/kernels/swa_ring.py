"""Sliding-window (SWA) ring update: FP8-round a chunk's window KV rows (act_fp8, official
inference/model.py L706–707) and write them at slots `position mod R` of the layer's ring. The
ring holds either the rounded values ([B, R, D] float) or packed rows ([B, R, D + D/32] uint8:
E4M3 codes, then E8M0 scale bytes; 528 B for D = 512).

The Metal kernel (metal/swa_ring.metal) fuses the rounding (or packing) and the slot writes into
one launch. `mx.fast.metal_kernel` outputs are fresh buffers, so it re-emits the whole ring; the
ops path scatters the rows and lets MLX reuse the ring's buffer when nothing else holds it.
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


def _surviving(rows: mx.array, offset: int, capacity: int):
    """The rows that stay in a ring of `capacity` slots, and their slots (no duplicates)."""
    keep = min(rows.shape[1], capacity)
    start = offset + rows.shape[1] - keep
    slots = mx.array(np.arange(start, start + keep) % capacity)  # made on the host: no ops
    return rows[:, rows.shape[1] - keep:], slots


def is_packed_ring(ring: mx.array, width: int) -> bool:
    """A uint8 ring of D + D/32 byte rows holds packed FP8 rows; otherwise rounded values."""
    if ring.dtype != mx.uint8:
        return False
    if ring.shape[-1] != width + width // ACT_FP8_BLOCK:
        raise ValueError(f"a packed ring for width {width} needs rows of "
                         f"{width + width // ACT_FP8_BLOCK} bytes, got {ring.shape[-1]}")
    return True


def swa_ring_update_ops(ring: mx.array, rows: mx.array, offset: int) -> mx.array:
    """Reference: ring [B, R, D] float or [B, R, D + D/32] uint8, rows [B, S, D] of positions
    offset .. offset + S - 1 -> the new ring (pure MLX)."""
    if rows.shape[1] == 0:
        return ring
    kept, slots = _surviving(rows, offset, ring.shape[1])
    if is_packed_ring(ring, rows.shape[-1]):
        values = pack_fp8_e8m0(kept)
    else:
        values = act_fp8_qdq(kept).astype(ring.dtype)
    index = mx.broadcast_to(slots[None, :, None], values.shape)
    return mx.put_along_axis(ring, index, values, axis=1)


def stacked_ring_update_ops(ring: mx.array, rows: mx.array, positions: tuple) -> mx.array:
    """`swa_ring_update_ops` of G sequences' packed rings at once, ops only: ring
    [G, R, D + D/32] stacked from theirs, rows [G, S, D] (S <= R), row g's of positions
    positions[g].. -> the new stacked ring, row g the bytes of its own update."""
    length, capacity = rows.shape[1], ring.shape[1]
    if length > capacity or not is_packed_ring(ring, rows.shape[-1]):
        raise ValueError(f"stacked_ring_update_ops: {length} rows for a ring of {capacity} "
                         f"slots, or a ring of {ring.dtype} (it writes up to R packed rows)")
    first = np.asarray(positions, np.int64)[:, None]
    slots = mx.array(((first + np.arange(length)) % capacity).astype(np.int32))
    values = pack_fp8_e8m0(rows)
    return mx.put_along_axis(ring, mx.broadcast_to(slots[..., None], values.shape), values,
                             axis=1)


def _launch(kernel, ring: mx.array, rows: mx.array, offset: int) -> mx.array:
    threads = ring.shape[0] * ring.shape[1] * rows.shape[-1]
    packed = is_packed_ring(ring, rows.shape[-1])
    out, = kernel(inputs=[ring, rows, int(offset)],
                  template=[("T", ring.dtype), ("PACKED", packed)],
                  grid=(threads, 1, 1), threadgroup=(simd_threadgroup(threads), 1, 1),
                  output_shapes=[ring.shape], output_dtypes=[ring.dtype])
    return out


def _probe(run, ops) -> None:
    """Three rows written across the end of a packed ring of 8: bytes equal to the ops'."""
    ring = (mx.arange(8 * 66, dtype=mx.uint32) % 251).astype(mx.uint8).reshape(1, 8, 66)
    rows = (mx.cos(mx.arange(3 * 64, dtype=mx.float32) * 0.21) * 5).reshape(1, 3, 64)
    rows = rows.astype(mx.bfloat16)
    assert_equal("swa_ring_update", run(ring, rows, 6), ops(ring, rows, 6))


# The kernel as `run(ring, rows, offset)`: metal/swa_ring.metal, rounding (or packing) and the
# slot writes in one launch.
SWA_RING_UPDATE = KernelSpec("v41_swa_ring_update", "swa_ring_update", ("ring", "rows", "offset"),
                             ("out",), "swa_ring.metal", _launch, _probe, swa_ring_update_ops,
                             headers=("v41_common.h",))


def swa_ring_update(ring: mx.array, rows: mx.array, offset: int, use_kernel: Optional[bool] = None,
                    run=None) -> mx.array:
    """Write a chunk's window rows into the ring, FP8-rounded.

    Args:
        ring: [B, R, D] rounded values, or [B, R, D + D/32] uint8 packed FP8 rows (slot =
            position mod R).
        rows: [B, S, D] window KV rows of positions offset .. offset + S - 1 (rounded or not:
            act_fp8 is idempotent on the values), D a multiple of 32; when S > R only the
            last R rows are kept.
        offset: absolute position of rows[:, 0] (>= 0).
        use_kernel: use the Metal kernel when it applies.
        run: an already built kernel (`SWA_RING_UPDATE.build(factory)`) to use unconditionally,
            e.g. the Metal simulator's in tests.
    Returns:
        The new ring, same shape and dtype; the kept rows' slots hold act_fp8_qdq(rows) or
        pack_fp8_e8m0(rows).
    """
    packed = is_packed_ring(ring, rows.shape[-1])
    run = SWA_RING_UPDATE.choose(use_kernel, run, applies=(
        rows.shape[1] > 0 and rows.dtype in _FLOAT_DTYPES and (packed or ring.dtype == rows.dtype)
        and rows.shape[-1] % ACT_FP8_BLOCK == 0 and offset >= 0))
    if run is None:
        return swa_ring_update_ops(ring, rows, offset)
    return run(ring, rows, offset)
