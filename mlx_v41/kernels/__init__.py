"""Custom kernels: each op has a pure-MLX reference (`*_ops`), a Metal body in metal/, and a
dispatcher the model calls. `Kernels` carries prebuilt kernels into a model, e.g. the Metal
simulator's in tests; by default the dispatchers decide (Metal when available)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from .fp4_pack import build_fp4_pack
from .sparse_attention import build_sparse_attention
from .swa_ring import build_swa_ring_update


@dataclass
class Kernels:
    use: bool = True                              # False: always the reference ops
    fp4_pack: Optional[Callable] = None
    sparse_attention: Optional[Callable] = None
    swa_ring_update: Optional[Callable] = None

    @classmethod
    def build(cls, metal_kernel) -> "Kernels":
        """All kernels built with one `metal_kernel` factory (MLX's or the simulator's)."""
        return cls(True, build_fp4_pack(metal_kernel), build_sparse_attention(metal_kernel),
                   build_swa_ring_update(metal_kernel))
