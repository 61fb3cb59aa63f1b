"""The DSpark drafter's per-sequence state: one ring per stage of the last `window` KV rows,
computed from `main_x` of committed target positions (slot = position mod window, bf16 values
already FP8-rounded). Drafted tokens never enter it, so a rejected draft leaves no trace.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx


class DraftRings:
    """Rings [B, window, d] of every stage and the number of positions written."""

    def __init__(self, window: int, stages: int):
        self.window, self.stages = window, stages
        self.rows: Optional[list] = None
        self.count = 0

    def write(self, rows: list, position: int) -> None:
        """Store each stage's rows [B, S, d] of positions [position, position + S)."""
        if position != self.count:
            raise ValueError(f"the draft rings hold positions up to {self.count - 1}; rows "
                             f"must continue at {self.count}, got {position}")
        length = rows[0].shape[1]
        keep = min(length, self.window)
        slots = mx.arange(position + length - keep, position + length) % self.window
        if self.rows is None:
            self.rows = [mx.zeros((r.shape[0], self.window, r.shape[-1]), r.dtype) for r in rows]
        self.rows = [mx.put_along_axis(ring, slots.reshape(1, -1, 1), r[:, -keep:], axis=1)
                     for ring, r in zip(self.rows, rows)]
        self.count = position + length

    def keys(self, stage: int) -> Optional[mx.array]:
        """The stage's ring rows in slot order (the reference's key order): every slot once
        the ring is full, else the positions written so far."""
        if self.rows is None:
            return None
        ring = self.rows[stage]
        return ring if self.count >= self.window else ring[:, :self.count]

    @property
    def state(self) -> list:
        return list(self.rows or [])

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.rows or [])
