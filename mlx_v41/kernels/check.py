"""A Metal kernel that cannot break a user's run: the first time a kernel is built it runs once
on a small input against its ops (`*_ops`); if building or running it raises (a Metal compile
error, say) or its result differs beyond the kernel's stated tolerance, one warning names the
kernel and its ops are used from then on."""

from __future__ import annotations

import warnings
from typing import Callable

import mlx.core as mx


class KernelMismatch(AssertionError):
    """A kernel's self-check result differs from its ops."""


def verified(name: str, build: Callable[[], Callable], probe: Callable, ops: Callable):
    """`build()`'s kernel if `probe(kernel, ops)` passes, else `ops` (one warning)."""
    try:
        run = build()
        probe(run, ops)
    except Exception as error:  # noqa: BLE001 - any failure of the kernel means: use the ops
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        warnings.warn(f"Metal kernel {name} failed its self-check ({type(error).__name__}: "
                      f"{reason[:200]}); using its MLX ops instead", RuntimeWarning, stacklevel=2)
        return ops
    return run


def assert_equal(name: str, got: mx.array, want: mx.array) -> None:
    """Bit-exact kernels: same shape, dtype and bytes."""
    if got.shape != want.shape or got.dtype != want.dtype:
        raise KernelMismatch(f"{name}: got {got.dtype} {got.shape}, expected {want.dtype} "
                             f"{want.shape}")
    if not mx.array_equal(got.view(mx.uint8), want.view(mx.uint8)).item():
        raise KernelMismatch(f"{name}: result differs from its ops")


def assert_close(name: str, got: mx.array, want: mx.array, tolerance: float) -> None:
    """|got - want| <= tolerance x max |want| everywhere (and both finite)."""
    if got.shape != want.shape:
        raise KernelMismatch(f"{name}: got shape {got.shape}, expected {want.shape}")
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    error = mx.abs(got - want).max().item()
    scale = mx.abs(want).max().item()
    if not (error <= tolerance * scale) or not mx.isfinite(got).all().item():
        raise KernelMismatch(f"{name}: max difference {error:.3g} from its ops exceeds "
                             f"{tolerance:.3g} x {scale:.3g}")
