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


_NUMPY = {mx.uint8: np.uint8, mx.int32: np.int32, mx.bool_: np.bool_, mx.float32: np.float32}


def stack_padded(parts: list, fill=0, axis: int = 1) -> mx.array:
    """`parts` [1, ...] each, stacked along axis 0 with axis `axis` (1 or 2) padded with `fill`
    to the longest: one concatenation and one gather whatever the number of parts (the index
    is made on the host), where padding each part would cost launches per part."""
    sizes = [p.shape[axis] for p in parts]
    longest = max(sizes)
    if len(set(sizes)) == 1:
        return stack(parts)
    total = sum(sizes)
    starts = np.cumsum([0, *sizes[:-1]])
    k = np.arange(longest)
    column = np.where(k < np.asarray(sizes)[:, None], starts[:, None] + k, total)  # [G, L]
    shape = list(parts[0].shape)
    shape[axis] = 1  # one slot of `fill` after the parts, made on the host: no launch
    filler = mx.array(np.full(shape, fill, _NUMPY[parts[0].dtype]))
    flat = mx.concatenate([p for p, n in zip(parts, sizes) if n] + [filler], axis=axis)[0]
    if axis == 1:  # flat [total + 1, ...]
        return mx.take(flat, mx.array(column.astype(np.int32)), axis=0)
    rows = flat.shape[0]  # axis 2: flat [n, total + 1, ...] with n rows before the axis
    index = np.arange(rows)[None, :, None] * (total + 1) + column[:, None, :]  # [G, n, L]
    return mx.take(flat.reshape(rows * (total + 1), *flat.shape[2:]),
                   mx.array(index.astype(np.int32)), axis=0)
