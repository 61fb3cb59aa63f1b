"""The model with every kernel (FP4 pack, SWA ring, fused sparse attention) routed through the
Metal simulator equals the model on the reference ops: packed cache bytes exactly, logits to
the attention kernel's stated bf16-level tolerance (its probabilities are rounded per block of
64 keys against the running max, the ops round against the row max). On the CPU backend, as
the simulator runs on the host; the real kernels are compared with their ops on a Metal device
in test_kernels.py."""

import mlx.core as mx
import numpy as np
import pytest

import mlx_v41
from mlx_v41.kernels import Kernels
from mlx_v41.model.batch import batch_forward
from mlx_v41.numerics.mhc import mhc_expand_ops, mhc_ops
from tests.kernel_faults import sim

pytestmark = pytest.mark.usefixtures("cpu")


@pytest.fixture(scope="module")
def models(tiny_model):
    simulated = tiny_model(Kernels.build(sim))
    reference = tiny_model(Kernels(use=False))
    return simulated, reference


@pytest.mark.slow
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


def counted_simulated_kernels(calls: dict) -> tuple:
    """(every kernel through the simulator, the inexact ones too, mHC as its ops (below),
    each call counted in `calls` by name; the names of the kernels)."""
    kernels = Kernels.build(sim, inexact=True)
    kernels.mhc, kernels.mhc_expand = mhc_ops, mhc_expand_ops

    def counted(name, run):
        def call(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return run(*args, **kwargs)
        return call

    fields = [f for f in vars(kernels) if callable(getattr(kernels, f))]
    for field in fields:
        setattr(kernels, field, counted(field, getattr(kernels, field)))
    return kernels, fields


@pytest.mark.slow
def test_every_metal_path_kernel_through_the_simulator(goldens, tiny_model):
    """The Metal path as a Mac runs it: every kernel, the fused ones too (`inexact=True`:
    norms, router, SwiGLU, window rows, query RoPE, index queries), through the simulator, each
    called, gives the ops' logits bit for bit over a prefill and two decode steps: the fused
    kernels sum in the ops' order, so only a GPU's own rounding could move them. The mHC
    kernels are the exception (their n*D-long sums run in another order; within 2^-15 at each
    block side, test_mhc_kernel.py, which this chaotic model amplifies to 0.19 by position 12),
    so here they run as their ops."""
    calls = {}
    kernels, fields = counted_simulated_kernels(calls)
    simulated = tiny_model(kernels)
    reference = tiny_model(Kernels(use=False))
    ids = goldens("tiny").prompt[None, :32].astype(mx.int32)  # 64 (token, expert) pairs: sorted
    cs, cr = simulated.make_cache(), reference.make_cache()
    assert mx.array_equal(simulated.prefill(ids, cs, last_only=False),
                          reference.prefill(ids, cr, last_only=False)).item()
    for token in (3, 4):
        step = mx.array([[token]], dtype=mx.int32)
        assert mx.array_equal(simulated(step, cache=cs), reference(step, cache=cr)).item()
    assert sorted(calls) == sorted(fields), set(fields) - set(calls)


@pytest.mark.slow
def test_a_batch_on_the_simulated_kernels_stacks_and_equals_each_sequence_alone(tiny_model):
    """The Metal path of a batched decode step: with every kernel simulated (the inexact ones
    too; mHC as its ops, as above), sequences at different positions, windows full or still
    filling, attend stacked, each kernel taking a position per batch row, sparse attention
    every sequence's selection padded to the widest and the filling windows' front padding
    left out (`window_first`): every sequence's logits and window ring equal its own batch-1
    step through the same kernels, bit for bit, and the attention kernels launch once per
    layer, not once per sequence. Three steps: from the second on the rings and the
    compressed rows are the ones the step before left stacked."""
    calls = {}
    model = tiny_model(counted_simulated_kernels(calls)[0])
    rng = np.random.default_rng(7)
    caches, firsts = [], []
    lengths = (24, 5, 40, 61, 11)  # past the window (16), different selection widths; filling
    for length in lengths:
        cache = model.make_cache()
        ids = mx.array(rng.integers(0, 400, (1, length)), dtype=mx.int32)
        firsts.append(int(mx.argmax(model.prefill(ids, cache)[0, -1]).item()))
        caches.append(cache)
    alone = [mlx_v41.copy_cache(c) for c in caches]
    ids = mx.array([[t] for t in firsts], dtype=mx.int32)
    for step in range(3):
        calls.clear()
        batched = batch_forward(model, ids, caches).logits
        mx.eval(batched)
        in_batch = dict(calls)
        for b in range(len(lengths)):
            calls.clear()
            own = model(ids[b:b + 1], cache=alone[b])
            assert mx.array_equal(batched[b:b + 1], own).item(), (step, b)
            for mine, its in zip(caches[b], alone[b]):
                assert mx.array_equal(mine.window.rows, its.window.rows).item()
                if mine.compressed is not None and mine.compressed.count:
                    assert mx.array_equal(mine.compressed.packed_rows(),
                                          its.compressed.packed_rows()).item()
        for name in ("window_rows", "swa_ring_update", "rope_products", "sparse_attention"):
            assert in_batch[name] == calls[name], (name, in_batch[name], calls[name])
        ids = mx.argmax(batched[:, -1:], axis=-1).astype(mx.int32)
