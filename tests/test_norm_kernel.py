"""The fused norm kernel (metal/norm.metal: [collapse ->] RMSNorm [-> RoPE] [-> act_fp8] in one
launch per call) through the Metal simulator against `norm_ops`, the model's own functions.

Stated tolerance (`kernels/norm.py` `check_close`): every bf16 value within one ulp of the ops'
and at most 2^-6 of them different, the fp32 copy exact, act_fp8 outputs the act_fp8 of the
kernel's own values. Measured here: no difference at all, on every shape and input below (the
kernel mirrors `_pairwise_mean`'s order; the simulator has no FMA and the CPU's rsqrt), so the
tests also hold it to the ops' bits; the tolerance is for a GPU, whose ops reduce in another
order. Races and coverage checked; odd widths (leaves of 12 and 10 channels, 96 and 160
threads), zero rows, rows spanning 2^±60, bf16 ties in the products."""

import functools

import mlx.core as mx
import numpy as np
import pytest

from mlx_v41.kernels import Kernels
from mlx_v41.kernels.norm import NORM, OUTPUTS, check_close, norm, norm_ops, threads_for
from mlx_v41.numerics.rope import RoPE
from tests.kernel_faults import checked, not_compiling, returning, warnings_of
from tests.metal_sim import metal_kernel

pytestmark = pytest.mark.usefixtures("cpu")


@functools.cache
def _run():
    return NORM.build(checked)


def _rows(rng, shape, spread: float = 2.0) -> np.ndarray:
    """Normal values with per-row scales e^(spread N(0, 1)); the first row all zero, the
    second spanning 2^-60 .. 2^60 (squares near fp32's ends), the third one outlier."""
    x = rng.standard_normal(shape) * np.exp(rng.standard_normal(shape[:-1] + (1,)) * spread)
    flat = x.reshape(-1, shape[-1])
    flat[0] = 0.0
    if len(flat) > 1:
        flat[1] *= 2.0 ** rng.integers(-60, 60, shape[-1])
    if len(flat) > 2:
        flat[2, rng.integers(shape[-1])] = 3e4
    return x.astype(np.float32)


def _weight(rng, width: int) -> mx.array:
    """bf16 values promoted to fp32, as the checkpoint's norm weights are."""
    w = rng.uniform(0.25, 2.0, width).astype(np.float32)
    return mx.array(w).astype(mx.bfloat16).astype(mx.float32)


def _same(got: tuple, want: tuple, outputs) -> None:
    check_close("test", got, want, outputs)  # the stated tolerance
    for g, w in zip(got, want):  # and, measured on the simulator, the ops' bits
        assert g.dtype == w.dtype and g.shape == w.shape
        assert mx.array_equal(g.view(mx.uint8), w.view(mx.uint8)).item()


def test_threads_per_width():
    """Halved (a pairwise level each) to at most 256 while the half stays a multiple of 32."""
    plans = {128: 128, 64: 64, 96: 96, 160: 160, 512: 256, 1280: 160, 5120: 160, 4096: 256,
             1056: None, 48: None, 0: None}
    assert {width: threads_for(width) for width in plans} == plans


@pytest.mark.parametrize("lead,width,outputs", [
    ((1, 3), 128, OUTPUTS), ((2, 3), 96, ("y", "fp8")), ((1, 2), 160, ("y", "y32")),
    ((1, 1), 1280, ("y",)), ((3, 1), 64, ("fp8", "y"))])
def test_collapse_and_norm_match_ops(lead, width, outputs):
    """The block inputs and the final norm: 4 copies collapsed with fp32 `pre` weights."""
    rng = np.random.default_rng(width)
    streams = mx.array(_rows(rng, lead + (4, width))).astype(mx.bfloat16)
    pre = mx.array(rng.uniform(-0.5, 1.5, lead + (4,)).astype(np.float32))
    args = (streams, _weight(rng, width), 1e-6)
    _same(_run()(*args, pre=pre, outputs=outputs), norm_ops(*args, pre=pre, outputs=outputs),
          outputs)


@pytest.mark.parametrize("lead,width,rope_dim,positions,fp8_dtype", [
    ((1, 5), 64, 16, 7, mx.bfloat16), ((2, 3), 96, 32, "array", mx.bfloat16),
    ((1, 4), 160, 64, 0, mx.float32)])
def test_products_norm_rope_act_fp8_match_ops(lead, width, rope_dim, positions, fp8_dtype):
    """The kv chain: fp32 products (a third of them bf16 ties), norm, RoPE at int or array
    positions, act_fp8."""
    rng = np.random.default_rng(width + rope_dim)
    x = _rows(rng, lead + (width,), spread=1.0) * 30
    ties = (x.view(np.uint32) & np.uint32(0xFFFF0000)) | np.uint32(0x8000)
    x = np.where(rng.random(x.shape) < 0.3, ties.view(np.float32), x)
    if positions == "array":
        positions = mx.array(rng.integers(0, 5000, lead[1]).astype(np.int32))
    chain = dict(products=True, rope=RoPE(rope_dim, 10000.0), positions=positions,
                 fp8_dtype=fp8_dtype)
    args = (mx.array(x), _weight(rng, width), 1e-6)
    for outputs in (("fp8",), ("y", "fp8")):
        _same(_run()(*args, outputs=outputs, **chain), norm_ops(*args, outputs=outputs, **chain),
              outputs)


YARN = {"original_max_position_embeddings": 65536, "factor": 16.0, "beta_fast": 32,
        "beta_slow": 1}
ROW_FORMS = {"tuple": tuple, "list": list,
             "array": lambda firsts: mx.array(firsts, dtype=mx.int32)[:, None]}


@pytest.mark.parametrize("length", [1, 3])
@pytest.mark.parametrize("firsts", [(0,), (70001,), (0, 70001), (65535, 3, 0),
                                    (131075, 0, 9, 65536), (5, 100000, 0, 1, 200000)])
def test_products_norm_rope_per_row_positions(firsts, length):
    """The kv chain of a batch, each row from its own first position (0, small, beyond YaRN's
    original 65536), in one launch: the ops' bits at the tuple, and row b those of a batch-1
    call at first[b]."""
    rows, width = len(firsts), 96
    rng = np.random.default_rng(rows * 10 + length)
    x = mx.array(_rows(rng, (rows, length, width), spread=1.0) * 30)
    rope = RoPE(32, 160000.0, YARN)
    args = (x, _weight(rng, width), 1e-6)
    chain = dict(products=True, rope=rope, outputs=("y", "fp8"), fp8_dtype=mx.bfloat16)
    form = ("tuple", "list", "array")[(rows + length) % 3]
    calls = []
    kernel = NORM.build(returning(lambda outputs: calls.append(1) or outputs, checked))
    got = norm(*args, positions=ROW_FORMS[form](firsts), run=kernel, **chain)
    assert len(calls) == 1
    _same(got, norm_ops(*args, positions=firsts, **chain), chain["outputs"])
    for b, first in enumerate(firsts):
        alone = _run()(x[b:b + 1], *args[1:], positions=first, **chain)
        _same(tuple(out[b:b + 1] for out in got), alone, chain["outputs"])


def test_per_row_positions_through_the_dispatcher():
    """`use_kernel=False` with per-row positions (each form): the ops' bits at the tuple; per-row
    positions of the wrong count: one line naming them."""
    rng = np.random.default_rng(6)
    x = mx.array(_rows(rng, (3, 2, 64)))
    firsts, rope = (9, 70000, 0), RoPE(16, 160000.0, YARN)
    chain = dict(products=True, rope=rope, outputs=("y", "fp8"), fp8_dtype=mx.bfloat16)
    args = (x, _weight(rng, 64), 1e-6)
    want = norm_ops(*args, positions=firsts, **chain)
    for form in ROW_FORMS.values():
        for got in (norm(*args, positions=form(firsts), use_kernel=False, **chain),
                    norm_ops(*args, positions=form(firsts), **chain)):
            _same(got, want, chain["outputs"])
    for run in (_run(), None):
        with pytest.raises(ValueError, match="^norm: positions holds 2 first positions for 3 "
                                             "batch rows$"):
            norm(*args, positions=(1, 2), run=run, **chain)
        with pytest.raises(ValueError, match=r"^norm: per-row positions must be an integer "
                                             r"array \[3, 1\]"):
            norm(*args, positions=mx.array([[1], [2]]), run=run, **chain)


def test_products_norm_act_fp8_match_ops():
    """The q chain: products, norm, its act_fp8 (fp32) for q_b_proj; and bf16 rows."""
    rng = np.random.default_rng(3)
    x = mx.array(_rows(rng, (2, 3, 64)))
    args = (x, _weight(rng, 64), 1e-6)
    outputs = ("y", "fp8")
    _same(_run()(*args, products=True, outputs=outputs),
          norm_ops(*args, products=True, outputs=outputs), outputs)
    x = x.astype(mx.bfloat16)
    _same(_run()(x, *args[1:], outputs=OUTPUTS), norm_ops(x, *args[1:], outputs=OUTPUTS),
          OUTPUTS)


def _bf16(x: np.ndarray) -> np.ndarray:
    return np.array(mx.array(x.astype(np.float32)).astype(mx.bfloat16).astype(mx.float32))


def _sums(squares: np.ndarray) -> tuple:
    """fp32 sums of squares in three orders: `_pairwise_mean`'s (halves, then the leaf in
    sequence), its leaf backwards, and all in sequence."""
    leaf = squares
    while len(leaf) % 2 == 0 and len(leaf) > 16:
        leaf = (leaf[:len(leaf) // 2] + leaf[len(leaf) // 2:]).astype(np.float32)
    orders = (leaf, leaf[::-1], squares)
    return tuple(functools.reduce(lambda a, b: np.float32(a + b), o, np.float32(0))
                 for o in orders)


def test_the_sum_of_squares_runs_in_the_ops_order():
    """A row whose sum of squares differs by order, and fp32 weights that put each output next
    to a bf16 rounding midpoint: an inverse rms one ulp off flips many outputs, beyond the
    stated tolerance too (the random inputs above rarely see a sum order)."""
    rng = np.random.default_rng(2)
    v = _bf16(rng.standard_normal(64) * np.exp(rng.standard_normal(64)))
    inverse_rms = [np.float32(1) / np.sqrt(np.float32(s / np.float32(64) + np.float32(1e-6)))
                   for s in _sums(v * v)]
    r = inverse_rms[0]
    assert r != inverse_rms[1] and r != inverse_rms[2]  # the order shows in r
    p = (v * r).astype(np.float32)
    midpoint = ((p.view(np.uint32) & np.uint32(0xFFFF0000)) | np.uint32(0x8000)).view(np.float32)
    weight = mx.array((midpoint / p).astype(np.float32))
    x = mx.array(v).astype(mx.bfloat16).reshape(1, 1, 64)
    _same(_run()(x, weight, 1e-6, outputs=("y",)), norm_ops(x, weight, 1e-6, outputs=("y",)),
          ("y",))


def test_the_tolerance_catches_a_wrong_value():
    """`check_close` fails a value two ulps off, too many one-ulp flips, and a fp8 output that
    is not the act_fp8 of the kernel's own values."""
    rng = np.random.default_rng(5)
    y = mx.array(rng.standard_normal((4, 64)).astype(np.float32)).astype(mx.bfloat16)
    bits = y.view(mx.uint16)
    two_ulps = mx.where(mx.arange(64) == 3, bits + 2, bits).view(mx.bfloat16)
    flips = mx.where(mx.arange(64) % 8 == 0, bits + 1, bits).view(mx.bfloat16)
    fp8 = norm_ops(y, mx.ones((64,)), 1e-6, outputs=("fp8",))[0]
    for wrong in (two_ulps, flips):
        with pytest.raises(AssertionError, match="ulp|differ"):
            check_close("t", (wrong,), (y,), ("y",))
    with pytest.raises(AssertionError, match="own y"):
        check_close("t", (y, fp8 * 0), (y, fp8), ("y", "fp8"))


def test_dispatcher_keeps_the_ops_where_the_kernel_does_not_apply():
    """Off Metal without a kernel, widths it does not plan, and non-bf16 copies: the ops
    (their bits); with a kernel where it applies: the kernel; bad outputs: one-line error."""
    rng = np.random.default_rng(9)
    calls = []

    def counted(*args):
        calls.append(args[0].shape)
        return norm_ops(*args)

    x = mx.array(_rows(rng, (1, 2, 64)))
    assert mx.array_equal(norm(x, mx.ones((64,)), 1e-6)[0],
                          norm_ops(x, mx.ones((64,)), 1e-6)[0]).item()
    for width in (48, 1056):
        norm(mx.ones((1, 2, width)), mx.ones((width,)), 1e-6, run=counted)
    streams = mx.ones((1, 2, 4, 64), mx.float32)  # fp32 copies: the collapse keeps fp32
    norm(streams, mx.ones((64,)), 1e-6, pre=mx.ones((1, 2, 4)), run=counted)
    assert calls == []
    norm(x, mx.ones((64,)), 1e-6, run=counted)
    assert calls == [(1, 2, 64)]
    with pytest.raises(ValueError, match="outputs must be"):
        norm(x, mx.ones((64,)), 1e-6, outputs=("z",))


def _one_ulp_up(outputs):
    """The bf16 outputs one ulp up everywhere (too many flips)."""
    y, y32, q8 = outputs
    return [(y.view(mx.uint16) + 1).view(mx.bfloat16), y32, q8]


@pytest.mark.parametrize("factory,reason", [(not_compiling(checked), "MetalCompileError"),
                                            (returning(_one_ulp_up, checked), "KernelMismatch")])
def test_a_failing_kernel_warns_once_and_runs_its_ops(factory, reason):
    run, messages = warnings_of(NORM.build_checked, factory)
    assert run is norm_ops
    assert len(messages) == 1 and "v41_norm" in messages[0] and reason in messages[0], messages


@pytest.mark.slow
def test_model_with_the_kernel_matches_the_ops(goldens, tiny_model):
    """The tiny golden model with every norm chain through the simulated kernel (4 per layer
    and the final norm): prompt logits and two decode steps equal the ops' (measured: bit for
    bit; the test allows 1e-3, well under the chaotic model's spread for a one-ulp flip)."""
    kernel, calls = NORM.build(metal_kernel), []

    def counted(*args):
        calls.append(args[0].shape)
        return kernel(*args)

    model = tiny_model(Kernels(norm=counted))
    reference = tiny_model(Kernels(use=False))
    ids = goldens("tiny").prompt[None, :8].astype(mx.int32)
    cache, cache_ref = model.make_cache(), reference.make_cache()
    got, want = model(ids, cache=cache), reference(ids, cache=cache_ref)
    assert mx.abs(got - want).max().item() <= 1e-3
    layers = len(model.model.layers)
    assert len(calls) >= 4 * layers + 1, (len(calls), layers)
    for token in (3, 4):
        step = mx.array([[token]], dtype=mx.int32)
        assert mx.abs(model(step, cache=cache) - reference(step, cache=cache_ref)).max() <= 1e-3
