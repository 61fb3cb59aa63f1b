"""Custom kernels: each op has a pure-MLX reference (`*_ops`), a Metal body in metal/, and a
dispatcher the model calls, which alone decides between the kernel and its ops. `Kernels` is a
set of prebuilt kernels (e.g. the Metal simulator's in tests) that a model call makes active
(`context.using`); by default the dispatchers decide (Metal when available, each kernel
self-checked against its ops the first time it is built: `check.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from .act_fp8 import ACT_FP8
from .context import using  # noqa: F401 - the package's API
from .fp4_pack import FP4_PACK
from .index_queries import INDEX_QUERIES
from .mhc import MHC, MHC_EXPAND
from .moe_order import MOE_ORDER
from .norm import NORM
from .rope_products import ROPE_PRODUCTS
from .router import ROUTER
from .sparse_attention import SPARSE_ATTENTION
from .spec import KernelSpec
from .swa_ring import SWA_RING_UPDATE
from .swiglu import SWIGLU_ACT_FP8
from .window_rows import WINDOW_ROWS

# Every kernel's spec: the bit-exact ones, then those within a stated tolerance of their ops.
SPECS: tuple[KernelSpec, ...] = (FP4_PACK, SPARSE_ATTENTION, SWA_RING_UPDATE, ACT_FP8,
                                 WINDOW_ROWS, MOE_ORDER, MHC, NORM, ROUTER, SWIGLU_ACT_FP8,
                                 ROPE_PRODUCTS, INDEX_QUERIES, MHC_EXPAND)

@dataclass
class Kernels:
    use: bool = True                              # False: always the reference ops
    fp4_pack: Optional[Callable] = None
    sparse_attention: Optional[Callable] = None
    swa_ring_update: Optional[Callable] = None
    mhc: Optional[Callable] = None
    act_fp8: Optional[Callable] = None
    moe_order: Optional[Callable] = None  # moe_order.py: the MoE's pairs in expert order
    # Fused kernels of the Metal path, within a stated tolerance of their ops:
    norm: Optional[Callable] = None            # norm.py: [collapse ->] RMSNorm [-> RoPE, act_fp8]
    router: Optional[Callable] = None          # router.py: MoE gate scores -> top-k ids, weights
    swiglu_act_fp8: Optional[Callable] = None  # kernels/swiglu.py: clamped SwiGLU [x w] -> act_fp8
    window_rows: Optional[Callable] = None     # window_rows.py: ring rows + new rows -> window
    rope_products: Optional[Callable] = None   # kernels/rope_products.py: bf16(products) -> RoPE
    index_queries: Optional[Callable] = None   # kernels/index_queries.py: RoPE -> fp4_e8m0 qdq
    mhc_expand: Optional[Callable] = None      # kernels/mhc.py: expand, then the next side's mixes
    host_sinkhorn: bool = True  # a few tokens' mHC Sinkhorn in NumPy on the CPU (same bits)

    @classmethod
    def build(cls, metal_kernel, check: bool = False, inexact: bool = False) -> "Kernels":
        """The kernels built with one `metal_kernel` factory (MLX's or the simulator's).

        `check`: each one self-checked against its ops first (a failure: its ops, and one
        warning naming it), as the dispatchers' own Metal kernels are. `inexact`: also the
        kernels that hold their ops' values within a stated tolerance rather than bit for bit
        (the mHC side and the fused kernels: their sums run in another order, as MLX's own
        Metal reductions do); otherwise the dispatchers decide for them, so that comparisons
        of the exact kernels through the simulator are not lost in the chaotic model's
        amplification of a last-bit difference."""
        specs = [spec for spec in SPECS if spec.exact or inexact]
        return cls(True, **{spec.field: (spec.build_checked if check else spec.build)(metal_kernel)
                            for spec in specs})
