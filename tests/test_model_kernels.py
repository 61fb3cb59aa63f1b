"""The model with every kernel (FP4 pack, SWA ring, fused sparse attention) routed through the
Metal simulator equals the model on the reference ops: packed cache bytes exactly, logits to
the attention kernel's stated bf16-level tolerance (its probabilities are rounded per block of
64 keys against the running max, the ops round against the row max). On the CPU backend, as
the simulator runs on the host; the real kernels are compared with their ops on a Metal device
in test_kernels.py."""

import mlx.core as mx
import pytest

from mlx_v41.kernels import Kernels
from mlx_v41.numerics.mhc import mhc_expand_ops, mhc_ops
from tests.kernel_faults import sim

pytestmark = pytest.mark.usefixtures("cpu")


@pytest.fixture(scope="module")
def models(tiny_model):
    simulated = tiny_model(Kernels.build(sim))
    reference = tiny_model(Kernels(use=False))
    return simulated, reference


def test_forward_through_simulated_kernels(models, goldens):
    simulated, reference = models
    ids = goldens("tiny").prompt[None, :40].astype(mx.int32)
    cs, cr = simulated.make_cache(), reference.make_cache()
    a = simulated.prefill(ids, cs, last_only=False)
    b = reference.prefill(ids, cr, last_only=False)
    assert mx.abs(a - b).max().item() < 0.05
    for x, y in zip(cs, cr):
        if x.compressed is not None:
            n = x.compressed.count
            assert mx.array_equal(x.compressed.kv[:, :n], y.compressed.kv[:, :n])
            assert mx.array_equal(x.compressed.index_k[:, :n], y.compressed.index_k[:, :n])
    for token in (3, 4):
        step = mx.array([[token]], dtype=mx.int32)
        assert mx.abs(simulated(step, cache=cs) - reference(step, cache=cr)).max().item() < 0.05


@pytest.mark.skipif(mx.metal.is_available(), reason="checks the fallback on machines without Metal")
def test_dispatchers_fall_back_to_ops_without_metal(goldens, tiny_model):
    """A default model (kernels on) equals one on the ops: without Metal every dispatcher
    falls back."""
    model = tiny_model()
    ids = goldens("tiny").prompt[None, :20].astype(mx.int32)
    off = tiny_model(Kernels(use=False))
    assert mx.array_equal(model(ids), off(ids))


def test_every_metal_path_kernel_through_the_simulator(goldens, tiny_model):
    """The Metal path as a Mac runs it: every kernel, the fused ones too (`inexact=True`:
    norms, router, SwiGLU, window rows, query RoPE, index queries), through the simulator, each
    called, gives the ops' logits bit for bit over a prefill and two decode steps: the fused
    kernels sum in the ops' order, so only a GPU's own rounding could move them. The mHC
    kernels are the exception (their n*D-long sums run in another order; within 2^-15 at each
    block side, test_mhc_kernel.py, which this chaotic model amplifies to 0.19 by position 12),
    so here they run as their ops."""
    kernels = Kernels.build(sim, inexact=True)
    kernels.mhc, kernels.mhc_expand = mhc_ops, mhc_expand_ops
    calls = {}

    def counted(name, run):
        def call(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return run(*args, **kwargs)
        return call

    fields = [f for f in vars(kernels) if callable(getattr(kernels, f))]
    for field in fields:
        setattr(kernels, field, counted(field, getattr(kernels, field)))
    simulated = tiny_model(kernels)
    reference = tiny_model(Kernels(use=False))
    ids = goldens("tiny").prompt[None, :12].astype(mx.int32)
    cs, cr = simulated.make_cache(), reference.make_cache()
    assert mx.array_equal(simulated.prefill(ids, cs, last_only=False),
                          reference.prefill(ids, cr, last_only=False)).item()
    for token in (3, 4):
        step = mx.array([[token]], dtype=mx.int32)
        assert mx.array_equal(simulated(step, cache=cs), reference(step, cache=cr)).item()
    assert sorted(calls) == sorted(fields), set(fields) - set(calls)
