"""Rows of several sequences stacked along axis 0 (a batched forward, `model/batch.py`): pick,
stack, split and reorder them. Each sequence is one row [1, ...]."""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def take_rows(a: mx.array, members: list) -> mx.array:
    """Rows `members` of axis 0 (all of them in order: `a` itself)."""
    if members == list(range(a.shape[0])):
        return a
    return mx.take(a, mx.array(members), axis=0)


def stack(parts: list) -> mx.array:
    """`parts` [1, ...] each, stacked along axis 0 (one part: itself)."""
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)


def split_rows(a: mx.array) -> list:
    """The rows [1, ...] of axis 0."""
    return mx.split(a, a.shape[0]) if a.shape[0] > 1 else [a]


def in_order(parts: list, order: list) -> mx.array:
    """The rows of `parts` (stacked along axis 0) hold sequences `order`: back in order."""
    return take_rows(stack(parts), [int(i) for i in np.argsort(order)])
