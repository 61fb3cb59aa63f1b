"""Metal that cannot break a user's run (kernels/check.py): every kernel is checked against its
ops on a small input when it is built; a compile error or a wrong result means one warning
naming the kernel and the ops from then on. Forced in the Metal simulator with a kernel body
that does not compile and with a kernel whose outputs are wrong, and with the production
builders here, where MLX's kernels cannot run (no Metal)."""

import warnings

import mlx.core as mx
import pytest

from mlx_v41.kernels import Kernels
from mlx_v41.kernels.act_fp8 import act_fp8_ops
from mlx_v41.kernels.fp4_pack import FP4_PACK, fp4_pack_ops
from mlx_v41.kernels.index_queries import index_queries_ops
from mlx_v41.kernels.moe_order import moe_order_ops
from mlx_v41.numerics.mhc import mhc_expand_ops, mhc_ops
from mlx_v41.kernels.norm import norm_ops
from mlx_v41.kernels.rope_products import rope_products_ops
from mlx_v41.kernels.router import router_ops
from mlx_v41.kernels.sparse_attention import sparse_attention_ops
from mlx_v41.kernels.swa_ring import swa_ring_update_ops
from mlx_v41.kernels.swiglu import swiglu_act_fp8_ops
from mlx_v41.kernels.window_rows import window_rows_ops
from tests.kernel_faults import not_compiling, sim, warnings_of, zeros

pytestmark = pytest.mark.usefixtures("cpu")

OPS = {"v41_fp4_pack": ("fp4_pack", fp4_pack_ops),
       "v41_sparse_attention": ("sparse_attention", sparse_attention_ops),
       "v41_swa_ring_update": ("swa_ring_update", swa_ring_update_ops),
       "v41_mhc": ("mhc", mhc_ops),
       "v41_mhc_expand": ("mhc_expand", mhc_expand_ops),
       "v41_norm": ("norm", norm_ops),
       "v41_window_rows": ("window_rows", window_rows_ops),
       "v41_rope_products": ("rope_products", rope_products_ops),
       "v41_index_queries": ("index_queries", index_queries_ops),
       "v41_router": ("router", router_ops),
       "v41_swiglu_act_fp8": ("swiglu_act_fp8", swiglu_act_fp8_ops),
       "v41_act_fp8": ("act_fp8", act_fp8_ops),
       "v41_moe_order": ("moe_order", moe_order_ops)}


def _build(factory):
    return warnings_of(Kernels.build, factory, check=True, inexact=True)


def test_kernels_that_pass_are_kept():
    kernels, messages = _build(sim)
    assert messages == []
    for field, ops in OPS.values():
        assert getattr(kernels, field) is not ops


@pytest.mark.parametrize("factory,reason", [(not_compiling(), "MetalCompileError"),
                                            (zeros, "KernelMismatch")])
@pytest.mark.slow
def test_a_failing_kernel_warns_once_and_runs_its_ops(factory, reason, goldens, tiny_model):
    kernels, messages = _build(factory)
    assert len(messages) == len(OPS)
    for name, (field, ops) in OPS.items():
        assert sum(f"kernel {name} failed" in m and reason in m for m in messages) == 1, \
            (name, messages)
        assert getattr(kernels, field) is ops
    model, reference = tiny_model(kernels), tiny_model(Kernels(use=False))
    ids = goldens("tiny").prompt[None, :24].astype(mx.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no further warning once built
        assert mx.array_equal(model(ids), reference(ids))


@pytest.mark.skipif(mx.metal.is_available(), reason="needs a machine where Metal cannot run")
def test_production_kernel_without_metal_falls_back_with_one_warning():
    """mx.fast.metal_kernel builds here but raises when called: the checked production
    builder returns the ops and says so once."""
    with pytest.warns(RuntimeWarning, match="v41_fp4_pack") as caught:
        run = FP4_PACK.build_checked()
    assert run is fp4_pack_ops and len(caught) == 1


@pytest.mark.metal
@pytest.mark.skipif(not mx.metal.is_available(), reason="needs a Metal device (macOS)")
def test_every_kernel_passes_its_self_check_on_device(goldens, tiny_model):
    """The Mac checklist's first line: Apple's compiler builds every kernel (the fused ones
    too) and each matches its ops on its probe, so none falls back; then the tiny golden
    model on the GPU with every kernel stays close to the CPU's ops (the mHC kernels and the
    GPU's own reductions sum in other orders: the early positions, where the random model is
    not yet chaotic)."""
    with warnings.catch_warnings(record=True) as caught, mx.stream(mx.gpu):
        warnings.simplefilter("always")
        kernels = Kernels.build(mx.fast.metal_kernel, check=True, inexact=True)
    assert [str(w.message) for w in caught if w.category is RuntimeWarning] == []
    for name, (field, ops) in OPS.items():
        assert getattr(kernels, field) is not ops, name
    model, reference = tiny_model(kernels), tiny_model(Kernels(use=False))
    ids = goldens("tiny").prompt[None, :6].astype(mx.int32)
    with mx.stream(mx.gpu):
        got = model(ids)
    assert mx.abs(got - reference(ids)).max().item() < 0.05
