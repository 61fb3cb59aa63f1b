"""Window rows of an attention call: the SWA ring's decoded rows of the positions just before the
call, followed by the call's own new window KV rows, trimmed to what the queries read.

The ops (`window_rows_ops`: a take of the ring slots, the FP8 + E8M0 decode, a concatenation and
a slice) are 3 to 5 launches per layer; the Metal kernel (metal/window_rows.metal) reads the ring
slots and the new rows in one launch. The call's position is one int for every batch row, or one
per batch row (sequences at different positions in one batch: still one launch). Decoding is
exact, so its values equal the ops' bit for bit.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from ..numerics.quant import ACT_FP8_BLOCK, unpack_fp8_e8m0
from .builder import simd_threadgroup
from .check import assert_equal
from .spec import KernelSpec
from .swa_ring import position_buffer, row_positions, swa_ring_update_ops


def recent_rows(ring: mx.array, position: int, count: int) -> mx.array:
    """Decoded rows [B, count, D] bf16 of positions position - count .. position - 1 of a packed
    ring [B, R, D + D/32] uint8 (slot = position mod R)."""
    slots = mx.array(np.arange(position - count, position) % ring.shape[1])  # host: no ops
    return unpack_fp8_e8m0(mx.take(ring, slots, axis=1))


def stacked_window_rows_ops(ring: mx.array, rows: mx.array, positions,
                            count: int) -> mx.array:
    """`window_rows_ops` (no skip) of G sequences at once (the per-row position), ops only:
    ring [G, R, D + D/32] stacked from their rings, rows [G, S, D] bf16, row g's of positions
    positions[g] .. (G ints, or an int array [G]) -> [G, count + S, D], row g the bits of its
    own call (decoding is exact). A row whose position is below `count` (its window still
    filling) reads zero rows for the positions before 0, so every row has `count` of them."""
    held = np.asarray(positions, np.int64)[:, None] - count + np.arange(count)
    slots = mx.array((held % ring.shape[1]).astype(np.int32))
    older = unpack_fp8_e8m0(mx.take_along_axis(ring, slots[..., None], axis=1))
    if held[:, 0].min() < 0:  # a window still filling: rows before position 0 are zeros
        older = mx.where(mx.array(held >= 0)[..., None], older, 0)
    return mx.concatenate([older, rows], axis=1)


def window_rows_ops(ring: mx.array, rows: mx.array, position, count: int,
                    skip: int) -> mx.array:
    """Reference: the ring's `count` rows before `position`, then `rows`, from row `skip` on
    (pure MLX; arguments as in `window_rows`). A per-row position (B ints, or an int array
    [B]) runs `stacked_window_rows_ops`."""
    if isinstance(position, mx.array):
        position = position.tolist()
    if count and isinstance(position, (int, np.integer)):
        rows = mx.concatenate([recent_rows(ring, position, count), rows], axis=1)
    elif count:
        rows = stacked_window_rows_ops(ring, rows, position, count)
    return rows[:, skip:]


def _launch(kernel, ring: mx.array, rows: mx.array, position, count: int,
            skip: int) -> mx.array:
    batch, fresh, width = rows.shape
    shape = (batch, count + fresh - skip, width)
    threads = shape[0] * shape[1] * width
    out, = kernel(inputs=[ring, rows, position_buffer(position, batch), int(count), int(skip)],
                  grid=(threads, 1, 1), threadgroup=(simd_threadgroup(threads), 1, 1),
                  output_shapes=[shape], output_dtypes=[mx.bfloat16])
    return out


def _probe(run, ops) -> None:
    """Five ring rows across the end of a ring of 8 (their scales 2^-22 .. 2^5), then two new
    rows, the first row skipped; then two batch rows at their own positions (row 0's ring rows
    across the end, row 1's not): bytes equal to the ops'."""
    values = mx.sin(mx.arange(2 * 8 * 64, dtype=mx.float32) * 0.37).reshape(2, 8, 64)
    values = values * mx.power(2.0, mx.arange(-13, 14, 3, dtype=mx.float32)[:8, None])
    ring = swa_ring_update_ops(mx.zeros((2, 8, 66), mx.uint8), values.astype(mx.bfloat16), 9)
    rows = (mx.cos(mx.arange(2 * 2 * 64, dtype=mx.float32)) * 3).reshape(2, 2, 64)
    rows = rows.astype(mx.bfloat16)
    assert_equal("window_rows", run(ring[:1], rows[:1], 17, 5, 1),
                 ops(ring[:1], rows[:1], 17, 5, 1))
    assert_equal("window_rows", run(ring, rows, (17, 14), 5, 1), ops(ring, rows, (17, 14), 5, 1))


# The kernel as `run(ring, rows, position, count, skip)` (position an int, or one per batch row):
# metal/window_rows.metal, which reads each batch row's position from the int32 [B] buffer
# `positions`.
WINDOW_ROWS = KernelSpec("v41_window_rows", "window_rows",
                         ("ring", "rows", "positions", "count", "skip"), ("out",),
                         "window_rows.metal", _launch, _probe, window_rows_ops,
                         headers=("v41_common.h", "attention_prep.h"))


def window_rows(ring: mx.array, rows: mx.array, position, count: int, skip: int = 0,
                use_kernel: Optional[bool] = None, run=None) -> mx.array:
    """The window rows an attention call reads.

    Args:
        ring: [B, R, D + D/32] uint8 packed window ring (kernels/swa_ring.py), slot = position
            mod R; None while nothing is written (then count is 0).
        rows: [B, S, D] bf16 window KV rows of positions position .. position + S - 1.
        position: absolute position of rows[:, 0], an int; or per batch row, a tuple or list
            of B ints or an int32/int64 array [B] (row b's rows are of positions
            position[b] .. ; one launch for all rows; the ops are `stacked_window_rows_ops`,
            row b the bits of a batch-1 call at position[b]).
        count: ring rows each batch row reads, those of positions position - count ..
            position - 1 (0 <= count <= min(position, R)). Per row, 0 <= count <= R: a row
            whose position is below count (its window still filling) gets zero rows for the
            positions before 0, so the rows of a batch line up (`sparse_attention`'s
            `window_first` leaves them out).
        skip: leading rows of the concatenation to leave out (0 <= skip <= count + S).
        use_kernel: use the Metal kernel when it applies.
        run: an already built kernel (`WINDOW_ROWS.build(factory)`) to use where it applies,
            e.g. the Metal simulator's in tests.
    Returns:
        [B, count + S - skip, D] bf16, identical to `window_rows_ops`.
    """
    per_row = row_positions("window_rows", position, rows.shape[0])
    capacity = 0 if ring is None else ring.shape[1]
    if per_row is not None and ring is not None and ring.shape[0] != rows.shape[0]:
        raise ValueError(f"window_rows: a ring of {ring.shape[0]} batch rows for rows of "
                         f"{rows.shape[0]}")
    for row, first in enumerate((position,) if per_row is None else per_row):
        held = capacity if per_row is not None else min(first, capacity)
        if not 0 <= count <= held or not 0 <= skip <= count + rows.shape[1]:
            where = "" if per_row is None else f" of row {row}"
            raise ValueError(f"window_rows: cannot read {count} ring rows before position "
                             f"{first}{where} (a ring of {capacity} slots) and leave out {skip} "
                             f"of {count + rows.shape[1]} rows")
    width = rows.shape[-1]
    run = WINDOW_ROWS.choose(use_kernel, run)
    if (run is None or count == 0
            or count + rows.shape[1] == skip or rows.ndim != 3 or rows.dtype != mx.bfloat16
            or ring.dtype != mx.uint8 or ring.shape[0] != rows.shape[0]
            or width % ACT_FP8_BLOCK or ring.shape[-1] != width + width // ACT_FP8_BLOCK):
        run = window_rows_ops  # also its errors
    return run(ring, rows, position if per_row is None else per_row, count, skip)
