"""One declaration per kernel. A `KernelSpec` holds what differs between kernels (the Metal
text, the launch that owns grid, threadgroup, template and output shapes, the self-check's probe,
the ops) and gives every kernel the same three things: the kernel built with a `metal_kernel`
factory (`build`: MLX's in production, the simulator's in tests), the same self-checked against
its ops (`build_checked`, check.py), and the dispatcher's choice between a kernel and its ops
(`choose`: the active set's kernel, context.py, else the Metal one where it applies)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

from .builder import build_kernel, metal_applies
from .check import verified
from .context import chosen


@dataclass(frozen=True, eq=False)
class KernelSpec:
    name: str          # the Metal kernel's name, "v41_act_fp8" (the self-check's warning names it)
    field: str         # its `Kernels` field, "act_fp8"
    inputs: tuple      # the Metal body's input names, in order
    outputs: tuple     # its output names
    body: str          # metal/<body>
    launch: Callable   # (kernel, *args, **kwargs) -> the result: grid, threadgroup, shapes
    probe: Callable    # (run, ops) -> None; raises (KernelMismatch) where run is not its ops
    ops: Callable      # the reference (pure MLX); a failed self-check runs it instead
    headers: tuple = ()  # metal/ helpers before the body, in order
    exact: bool = True   # its values are its ops' bits (False: within a stated tolerance)
    methods: tuple = ()  # (name, fn(kernel, *args)): more entries of the built run

    def build(self, metal_kernel=None) -> Callable:
        """The kernel as `run(*args)` (the dispatcher's arguments), built from its Metal text
        with `metal_kernel` (mx.fast.metal_kernel by default; tests pass the simulator)."""
        kernel = build_kernel(self.name, self.inputs, self.outputs, self.body, self.headers,
                              factory=metal_kernel)

        def run(*args, **kwargs):
            return self.launch(kernel, *args, **kwargs)

        run.__name__ = run.__qualname__ = self.name
        for name, method in self.methods:
            setattr(run, name, functools.partial(method, kernel))
        run.kernel = kernel  # the factory's kernel object (tests read its generated text)
        return run

    def build_checked(self, metal_kernel=None) -> Callable:
        """`build(metal_kernel)` if it passes its self-check, else `ops` (one warning)."""
        return verified(self.name, lambda: self.build(metal_kernel), self.probe, self.ops)

    def metal(self) -> Callable:
        """The GPU's kernel: `build_checked()` once per process."""
        return _metal(self)

    def choose(self, use_kernel: Optional[bool] = None, run: Optional[Callable] = None,
               applies: bool = True) -> Optional[Callable]:
        """The kernel a dispatcher runs, or None for its ops: the caller's `run` or the active
        set's (context.chosen) as given; else, with `use_kernel` and where Metal runs and
        `applies` (the inputs the Metal kernel takes), the Metal kernel, built on first use.
        A dispatcher that runs even a given kernel only where it applies tests its conditions
        on the result instead (`if run is None or not applies(...)`)."""
        use_kernel, run = chosen(self.field, use_kernel, run)
        if run is not None:
            return run
        if use_kernel and applies and metal_applies():
            return self._metal_run
        return None

    def _metal_run(self, *args, **kwargs):
        return self.metal()(*args, **kwargs)


@functools.cache
def _metal(spec: KernelSpec) -> Callable:
    return spec.build_checked()


def runs_ops(*specs: KernelSpec) -> bool:
    """Whether each of these dispatchers runs its ops in the active context (no kernel given
    nor Metal). A caller that runs their ops over rows stacked from several calls keeps each
    call's bits only then: the kernels hold their ops' values to a tolerance, not bit for bit."""
    return all(spec.choose() is None for spec in specs)
