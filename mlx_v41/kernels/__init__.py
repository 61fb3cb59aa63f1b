"""Custom kernels: each op has a pure-MLX reference (`*_ops`), a Metal body in metal/, and a
dispatcher the model calls. `Kernels` carries prebuilt kernels into a model, e.g. the Metal
simulator's in tests; by default the dispatchers decide (Metal when available, each kernel
self-checked against its ops the first time it is built: `check.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from .act_fp8 import build_act_fp8, build_checked_act_fp8
from .fp4_pack import build_checked_fp4_pack, build_fp4_pack
from .mhc import build_checked_mhc, build_mhc
from .sparse_attention import build_checked_sparse_attention, build_sparse_attention
from .swa_ring import build_checked_swa_ring_update, build_swa_ring_update


@dataclass
class Kernels:
    use: bool = True                              # False: always the reference ops
    fp4_pack: Optional[Callable] = None
    sparse_attention: Optional[Callable] = None
    swa_ring_update: Optional[Callable] = None
    mhc: Optional[Callable] = None
    act_fp8: Optional[Callable] = None
    host_sinkhorn: bool = True  # a few tokens' mHC Sinkhorn in NumPy on the CPU (same bits)

    @classmethod
    def build(cls, metal_kernel, check: bool = False, include_mhc: bool = False) -> "Kernels":
        """The kernels built with one `metal_kernel` factory (MLX's or the simulator's).

        `check`: each one self-checked against its ops first (a failure: its ops, and one
        warning naming it), as the dispatchers' own Metal kernels are. `include_mhc`: the mHC
        kernel too; otherwise the dispatcher decides for it (its n*D-long sums run in another
        order than the ops, within 2^-15, which the chaotic model amplifies, so comparisons of
        the other kernels through the simulator keep the mHC ops)."""
        builders = {"fp4_pack": build_fp4_pack, "sparse_attention": build_sparse_attention,
                    "swa_ring_update": build_swa_ring_update, "act_fp8": build_act_fp8}
        if check:
            builders = {"fp4_pack": build_checked_fp4_pack,
                        "sparse_attention": build_checked_sparse_attention,
                        "swa_ring_update": build_checked_swa_ring_update,
                        "act_fp8": build_checked_act_fp8}
        if include_mhc:
            builders["mhc"] = build_checked_mhc if check else build_mhc
        return cls(True, **{name: build(metal_kernel) for name, build in builders.items()})
