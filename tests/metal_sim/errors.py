"""Exceptions raised by the Metal simulator."""


class MetalSimError(RuntimeError):
    """Base class for simulator errors."""


class MetalCompileError(MetalSimError):
    """The kernel text does not compile (g++ diagnostics remapped to [header:N] / [source:N])."""


class KernelRuntimeError(MetalSimError):
    """A detector fired or the kernel failed at run time (threadgroup and source line named)."""
