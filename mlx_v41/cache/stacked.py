"""Per-sequence arrays that stay stacked between batch steps: a window ring (or a compressor's
input ring) [1, ...] may be row `slot` of one array [G, ...] that the same ring of G sequences
of a batch share, so a step updates them all with one launch and hands the result on as is,
where restacking and splitting would cost launches every step.

A shared attribute reads as its row (a view); writing the attribute gives the holder its own
array again. Rows of different lengths share one array right-aligned along axis 1 (`share`'s
`lengths`): each reads as its last `length` columns (the Engram id histories of sequences of
different lengths). `stacked` reuses the shared array when the holders are its rows in order; a
sequence leaving the batch takes its rows out with `unshare_cache`, so a finished cache never
keeps the batch's arrays alive.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np


class Stackable:
    """An array attribute that is either the holder's own array or a row of a shared one. Both
    live in the holder's `__dict__` (a snapshot of `vars()` restores either exactly)."""

    def __set_name__(self, owner, name: str) -> None:
        self.own, self.shared = f"_{name}", f"_{name}_shared"

    def __get__(self, holder, owner=None):
        if holder is None:
            return self
        shared = holder.__dict__.get(self.shared)
        if shared is None:
            return holder.__dict__.get(self.own)
        array, slot, length = shared
        row = array if array.shape[0] == 1 else array[slot:slot + 1]
        return row if length == array.shape[1] else row[:, array.shape[1] - length:]

    def __set__(self, holder, value: Optional[mx.array]) -> None:
        holder.__dict__[self.own] = value
        holder.__dict__[self.shared] = None


def _field(holder, name: str) -> Stackable:
    return getattr(type(holder), name)  # the descriptor itself (a subclass inherits it)


def is_held(holder, name: str) -> bool:
    """Whether the attribute holds an array (without making a view of a shared row)."""
    field = _field(holder, name)
    return is_shared(holder, name) or holder.__dict__.get(field.own) is not None


def is_shared(holder, name: str) -> bool:
    """Whether the attribute is a row of an array shared with other sequences."""
    return holder.__dict__.get(_field(holder, name).shared) is not None


def holding(holder, name: str) -> Optional[tuple]:
    """What the attribute holds, as a key equal for holders of the same array (the same row
    of the same shared array, or the same own array); None while it holds nothing."""
    field = _field(holder, name)
    shared = holder.__dict__.get(field.shared)
    if shared is not None:
        return id(shared[0]), shared[1], shared[2]
    own = holder.__dict__.get(field.own)
    return None if own is None else (id(own),)


def row_shape(holder, name: str) -> Optional[tuple]:
    """The attribute's shape after the batch axis (None while it holds nothing)."""
    field = _field(holder, name)
    shared = holder.__dict__.get(field.shared)
    if shared is not None:
        array, _, length = shared
        return (length,) + tuple(array.shape[2:])
    array = holder.__dict__.get(field.own)
    return None if array is None else tuple(array.shape[1:])


def stacked(holders: list, name: str, padded: bool = False) -> mx.array:
    """The holders' arrays stacked along axis 0: the array they share when they are its rows in
    order (no launch), else one concatenation (`padded`: axis 1 padded with zeros to the
    longest, `stack_padded`)."""
    shared = _shared_whole(holders, name)
    if shared is not None and all(length == shared.shape[1] for length in
                                  _lengths(holders, name)):
        return shared
    parts = [getattr(h, name) for h in holders]
    if padded:
        return stack_padded(parts)
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)


def stacked_right(holders: list, name: str) -> tuple[mx.array, list]:
    """The holders' arrays right-aligned along axis 1 in one array [G, longest, ...] (zeros
    before a shorter one's columns), and each one's length: the array they share when they are
    its rows in order (no launch), else one concatenation and one gather."""
    shared = _shared_whole(holders, name)
    if shared is not None:
        return shared, _lengths(holders, name)
    parts = [getattr(h, name) for h in holders]
    return stack_padded(parts, align="right"), [p.shape[1] for p in parts]


def _shared_whole(holders: list, name: str) -> Optional[mx.array]:
    """The array the holders share when they are its rows in order, else None."""
    field = _field(holders[0], name)
    shared = [h.__dict__.get(field.shared) for h in holders]
    first = shared[0]
    if first is not None and first[0].shape[0] == len(holders) and all(
            s is not None and s[0] is first[0] and s[1] == g for g, s in enumerate(shared)):
        return first[0]
    return None


def _lengths(holders: list, name: str) -> list:
    field = _field(holders[0], name)
    return [h.__dict__[field.shared][2] for h in holders]


def share(holders: list, name: str, array: mx.array, lengths: Optional[list] = None) -> None:
    """Row g of `array` [G, ...] is now holders[g]'s attribute (`lengths`: its last
    lengths[g] columns of axis 1, the rows right-aligned)."""
    lengths = lengths or [array.shape[1]] * len(holders)
    if len(holders) == 1:
        setattr(holders[0], name, array if lengths[0] == array.shape[1]
                else array[:, array.shape[1] - lengths[0]:])
        return
    field = _field(holders[0], name)
    for g, (holder, length) in enumerate(zip(holders, lengths)):
        holder.__dict__[field.own] = None
        holder.__dict__[field.shared] = (array, g, length)


def unshare(holder, name: str, length: Optional[int] = None) -> None:
    """Give the holder its own copy of a shared row (one gather; `length`: its first rows of
    axis 1 only), so the shared array can go."""
    field = _field(holder, name)
    shared = holder.__dict__.get(field.shared)
    if shared is not None:
        array, slot, own = shared
        if own != array.shape[1]:
            array = array[:, array.shape[1] - own:]
        if length is not None:
            array = array[:, :length]
        setattr(holder, name, mx.take(array, mx.array([slot]), axis=0))


_NUMPY = {mx.uint8: np.uint8, mx.int32: np.int32, mx.bool_: np.bool_, mx.float32: np.float32}


def stack_padded(parts: list, fill=0, axis: int = 1, align: str = "left") -> mx.array:
    """`parts` [1, ...] each, stacked along axis 0 with axis `axis` (1 or 2) padded with `fill`
    to the longest (after each part; `align="right"`: before it, axis 1 only): one
    concatenation and one gather whatever the number of parts (the index is made on the host),
    where padding each part would cost launches per part."""
    sizes = [p.shape[axis] for p in parts]
    longest = max(sizes)
    if len(set(sizes)) == 1:
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
    total = sum(sizes)
    starts = np.cumsum([0, *sizes[:-1]])
    k = np.arange(longest)
    if align == "right":  # part g's columns end at the last one (axis 1 only)
        assert axis == 1, axis
        k = k - (longest - np.asarray(sizes))[:, None]
    column = np.where((k >= 0) & (k < np.asarray(sizes)[:, None]), starts[:, None] + k,
                      total)  # [G, L]
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
