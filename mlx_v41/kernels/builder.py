"""The one way production code builds a Metal kernel: from text shipped in ``mlx_v41.metal``.

The repository's top-level ``metal/`` folder is installed as the package ``mlx_v41.metal``
(see pyproject). Its ``.metal`` files are kernel *bodies* and its ``.h`` files helpers: the text
that ``mx.fast.metal_kernel`` wraps in the signature it generates, never standalone Metal files.

``build_kernel`` takes the ``metal_kernel`` factory as an argument, so the same Metal text runs
on the GPU in production (``mx.fast.metal_kernel``) and in the Linux simulator in tests
(``tests.metal_sim.metal_kernel``). Kernels call it through their ``KernelSpec`` (spec.py), whose
``launch(kernel, *args)`` owns grid, threadgroup, template, output shapes and dtypes::

    FP4_PACK = KernelSpec("v41_fp4_pack", "fp4_pack", ("x",), ("out",), "fp4_pack.metal",
                          _launch, _probe, fp4_pack_ops, headers=("v41_common.h",))
    run = FP4_PACK.build(metal_kernel)  # build_kernel(...), then run(rows, kind)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path

import mlx.core as mx

METAL_PACKAGE = "mlx_v41.metal"


def _metal_files(package: str):
    # A source checkout (installed or not): the `metal/` next to this `mlx_v41/`, so that a
    # checkout never runs the Metal text of another one an editable install points at.
    checkout = Path(__file__).resolve().parents[2] / "metal"
    if package == METAL_PACKAGE and (checkout / "v41_common.h").is_file():
        return checkout
    return resources.files(package)


def metal_text(name: str, package: str = METAL_PACKAGE) -> str:
    """The text of ``name`` (e.g. ``"fp4.h"``) from the installed Metal package data."""
    f = _metal_files(package).joinpath(name)
    if not f.is_file():
        raise FileNotFoundError(f"no Metal file {name!r} in package {package}")
    return f.read_text(encoding="utf-8")


def build_kernel(
    name: str,
    input_names: Sequence[str],
    output_names: Sequence[str],
    body_file: str,
    header_files: Sequence[str] = (),
    *,
    factory: Callable | None = None,
    package: str = METAL_PACKAGE,
    ensure_row_contiguous: bool = True,
    atomic_outputs: bool = False,
):
    """Build a kernel from ``body_file`` (+ ``header_files``, in order) with ``factory``.

    ``factory`` has the signature of ``mx.fast.metal_kernel`` and defaults to it; tests pass the
    simulator's factory. Returns whatever the factory returns (a callable kernel object).
    """
    if factory is None:
        factory = mx.fast.metal_kernel
    header = ""
    for h in header_files:
        text = metal_text(h, package)
        header += text if text.endswith("\n") else text + "\n"
    return factory(
        name=name,
        input_names=list(input_names),
        output_names=list(output_names),
        source=metal_text(body_file, package),
        header=header,
        ensure_row_contiguous=ensure_row_contiguous,
        atomic_outputs=atomic_outputs,
    )


def metal_applies() -> bool:
    """Metal kernels run only on the GPU device: with the CPU chosen on a Mac (or no Metal),
    the dispatchers use the reference ops."""
    return mx.metal.is_available() and mx.default_device() == mx.gpu


def simd_threadgroup(threads: int) -> int:
    """Largest of 256/128/64/32 dividing `threads` (a multiple of 32), for kernels whose
    simdgroups each own one 32-value block: a simd_max needs full, uniform simdgroups and the
    grid an exact multiple of the threadgroup."""
    return next(t for t in (256, 128, 64, 32) if threads % t == 0)


_BUFFERS: dict = {}  # id(array) -> (array, padded): each small input padded once


def device_buffer(x: mx.array) -> mx.array:
    """x as fp32, zero-padded to at least 8 elements: MLX binds smaller kernel inputs as
    `constant`, a different kernel. Made once per array (a layer's mix scales, a small model's
    attention sinks) instead of a Full and a Concatenate in every call; the entry holds the
    array, so its id is not reused while cached."""
    if x.size >= 8:
        return x.astype(mx.float32)
    entry = _BUFFERS.get(id(x))
    if entry is None or entry[0] is not x:
        if len(_BUFFERS) >= 1024:
            _BUFFERS.clear()
        padded = mx.concatenate([x.reshape(-1).astype(mx.float32),
                                 mx.zeros((8 - x.size,), mx.float32)])
        entry = _BUFFERS[id(x)] = (x, padded)
    return entry[1]
