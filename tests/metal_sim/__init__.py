"""Metal Shading Language simulator for testing ``metal/`` kernels on Linux (test-only).

``metal_kernel`` is a drop-in for ``mx.fast.metal_kernel``: same arguments, same call, and the
kernel's exact MLX-generated Metal text compiled as C++ against an MSL shim and run with every
threadgroup's threads in lockstep. See README.md in this folder.
"""

from .errors import KernelRuntimeError, MetalCompileError, MetalSimError
from .kernel import SimKernel, SimOptions, metal_kernel

__all__ = ["metal_kernel", "SimKernel", "SimOptions", "MetalSimError", "MetalCompileError",
           "KernelRuntimeError"]
