"""Custom kernels: each op has a pure-MLX reference (`*_ops`), a Metal body in metal/, and a
dispatcher the model calls, which alone decides between the kernel and its ops. `Kernels` is a
set of prebuilt kernels (e.g. the Metal simulator's in tests) that a model call makes active
(`context.using`); by default the dispatchers decide (Metal when available, each kernel
self-checked against its ops the first time it is built: `check.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from .act_fp8 import build_act_fp8, build_checked_act_fp8
from .context import active, using  # noqa: F401 - the package's API
from .fp4_pack import build_checked_fp4_pack, build_fp4_pack
from .mhc import build_checked_mhc, build_mhc
from .sparse_attention import build_checked_sparse_attention, build_sparse_attention
from .swa_ring import build_checked_swa_ring_update, build_swa_ring_update
from .window_rows import build_checked_window_rows, build_window_rows


@dataclass
class Kernels:
    use: bool = True                              # False: always the reference ops
    fp4_pack: Optional[Callable] = None
    sparse_attention: Optional[Callable] = None
    swa_ring_update: Optional[Callable] = None
    mhc: Optional[Callable] = None
    act_fp8: Optional[Callable] = None
    # Fused kernels of the Metal path (issue 13), within a stated tolerance of their ops:
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
        builders = {"fp4_pack": build_fp4_pack, "sparse_attention": build_sparse_attention,
                    "swa_ring_update": build_swa_ring_update, "act_fp8": build_act_fp8,
                    "window_rows": build_window_rows}
        if check:
            builders = {"fp4_pack": build_checked_fp4_pack,
                        "sparse_attention": build_checked_sparse_attention,
                        "swa_ring_update": build_checked_swa_ring_update,
                        "act_fp8": build_checked_act_fp8,
                        "window_rows": build_checked_window_rows}
        if inexact:
            builders["mhc"] = build_checked_mhc if check else build_mhc
            builders.update(_inexact_builders(check))
        return cls(True, **{name: build(metal_kernel) for name, build in builders.items()})


def _inexact_builders(check: bool) -> dict:
    """The fused kernels' builders (checked or not), by `Kernels` field."""
    builders: dict = {}
    from .norm import build_checked_norm, build_norm
    builders["norm"] = build_checked_norm if check else build_norm
    from .router import build_checked_router, build_router
    builders["router"] = build_checked_router if check else build_router
    from .swiglu import build_checked_swiglu_act_fp8, build_swiglu_act_fp8
    builders["swiglu_act_fp8"] = build_checked_swiglu_act_fp8 if check else build_swiglu_act_fp8
    # [window_rows]: bit-exact, built with the exact kernels in `Kernels.build`
    from .rope_products import build_checked_rope_products, build_rope_products
    builders["rope_products"] = build_checked_rope_products if check else build_rope_products
    from .index_queries import build_checked_index_queries, build_index_queries
    builders["index_queries"] = build_checked_index_queries if check else build_index_queries
    from .mhc import build_checked_mhc_expand, build_mhc_expand
    builders["mhc_expand"] = build_checked_mhc_expand if check else build_mhc_expand
    return builders
