"""Which kernels a call runs. A `Kernels` set (kernels/__init__.py) is made active for the
duration of a model call with `using`; every dispatcher reads it through `chosen`, so the model
never passes kernels around nor chooses between a kernel and its ops. With none active the
dispatchers take their defaults: the Metal kernel where it applies, else the ops."""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Optional

import mlx.core as mx

_ACTIVE: ContextVar = ContextVar("mlx_v41_kernels", default=None)


@contextmanager
def using(kernels):
    """Make `kernels` (a `Kernels`, or None for the defaults) the active set within the block,
    in this thread; the previous set is restored on exit."""
    token = _ACTIVE.set(kernels)
    try:
        yield kernels
    finally:
        _ACTIVE.reset(token)


def chosen(field: str, use_kernel: Optional[bool] = None,
           run: Optional[Callable] = None) -> tuple:
    """(use_kernel, run) for the dispatcher of the `Kernels` field `field`: the caller's own
    arguments where it gives any (a test calling a dispatcher directly), else the active set's,
    else (True, None): Metal where it applies."""
    if use_kernel is not None or run is not None:
        return (True if use_kernel is None else use_kernel), run
    kernels = _ACTIVE.get()
    if kernels is None:
        return True, None
    return kernels.use, getattr(kernels, field)


def host_sinkhorn() -> bool:
    """Whether the mHC ops may run a few tokens' Sinkhorn in NumPy on the CPU (the active
    set's `host_sinkhorn`; True by default)."""
    kernels = _ACTIVE.get()
    return True if kernels is None else kernels.host_sinkhorn


_SETTLE: ContextVar = ContextVar("mlx_v41_settle", default=False)


@contextmanager
def short_evaluations():
    """Within the block, in this thread, `settle` evaluates: the model's graph is run in short
    evaluations instead of one per mHC side. For a thread that computes beside another (the
    prompt thread): MLX counts the tasks in flight over all streams together, and an
    evaluation that finds more than 10 waits for one to end after each of its own dispatches,
    so one thread's long evaluation makes every dispatch of the other's wait."""
    token = _SETTLE.set(True)
    try:
        yield
    finally:
        _SETTLE.reset(token)


def evaluations_short() -> bool:
    """Whether `short_evaluations` is active in this thread."""
    return _SETTLE.get()


def settle(*arrays) -> None:
    """Evaluate `arrays` now within `short_evaluations`; elsewhere nothing (they stay lazy).
    The values are the same either way."""
    if evaluations_short():
        mx.eval(*arrays)
