"""The act_fp8 kernel (metal/act_fp8.metal: FP8 activation fake-quant in one launch) through the
Metal simulator against `fp8_activation.act_fp8_qdq`, bit for bit: every step is exact arithmetic (a
power-of-two scale, E4M3 round-to-nearest-even), so any difference is a bug. The blocks cover
their maximum at 448 x 2^k and just above it (the next scale), every E4M3 midpoint (ties to
even, up to the 448 saturation), the E4M3 subnormals and the values that round to zero, zero
and all-zero blocks (the 1e-4 floor), negative values, and fp32 products whose bf16 rounding
(ties included) is the activation; bf16 / f16 / fp32 inputs and outputs, races and coverage
checked."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_v41.kernels import Kernels
from mlx_v41.kernels.act_fp8 import ACT_FP8, act_fp8
from mlx_v41.numerics.fp8_activation import act_fp8_qdq
from tests.kernel_faults import checked
from tests.metal_sim import metal_kernel

pytestmark = pytest.mark.usefixtures("cpu")


def _e4m3_grid() -> np.ndarray:
    """The 127 non-negative finite E4M3FN values, ascending (decoded here from the format)."""
    codes = np.arange(0x7F)
    exponent, mantissa = codes >> 3, codes & 7
    normal = (1 + mantissa / 8) * 2.0 ** (exponent - 7)
    return np.where(exponent == 0, mantissa * 2.0 ** -9, normal)


GRID = _e4m3_grid()
MIDPOINTS = (GRID[1:] + GRID[:-1]) / 2  # ties: the even code wins


def _block(rng, kind: str) -> np.ndarray:
    """32 values whose scale is 2^k: the grid points, midpoints and subnormals times 2^k."""
    k = int(rng.integers(-12, 12))
    pick = np.concatenate([MIDPOINTS, GRID, MIDPOINTS[:8] * 0.5, [2.0 ** -10, 2.0 ** -11]])
    v = rng.choice(pick, 32) * rng.choice([-1.0, 1.0], 32)
    if kind == "max":          # the block maximum is exactly 448 x 2^k: scale 2^k
        v[rng.integers(32)] = rng.choice([-448.0, 448.0])
    elif kind == "above":      # just above 448 x 2^k: scale 2^(k + 1), everything halves
        v[rng.integers(32)] = 448.0 * (1 + 2.0 ** -7)
    elif kind == "zeros":
        return rng.choice([0.0, -0.0], 32)
    elif kind == "tiny":       # amax below the 1e-4 floor: scale 2^-22, deep subnormals
        return rng.choice(pick, 32) * rng.choice([-1.0, 1.0], 32) * 2.0 ** -31
    return v * 2.0 ** k


def _activations(seed: int, blocks: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    kinds = ["max", "above", "zeros", "tiny", "max", "above"]
    return np.stack([_block(rng, kinds[i % len(kinds)]) for i in range(blocks)])


def _products(values: np.ndarray, seed: int) -> np.ndarray:
    """fp32 values whose bf16 rounding matters: bf16 half-ulp ties and small perturbations."""
    rng = np.random.default_rng(seed)
    x = values.astype(np.float32)
    bits = x.view(np.uint32)
    tie = (bits + np.uint32(0x8000)).view(np.float32)           # exactly between two bf16s
    jitter = (x * (1 + rng.uniform(-2.0 ** -9, 2.0 ** -9, x.shape))).astype(np.float32)
    return np.where(rng.random(x.shape) < 0.3, tie, np.where(rng.random(x.shape) < 0.5,
                                                             jitter, x))


def _same_bits(got: mx.array, want: mx.array) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    g, w = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    differ = g.view(np.uint32) != w.view(np.uint32)
    assert not differ.any(), (int(differ.sum()), g[differ][:4], w[differ][:4])


def test_the_inputs_cover_the_edge_cases():
    """The test blocks reach each case (so a kernel that mishandles one cannot pass)."""
    x = mx.array(_activations(0, 24).astype(np.float32))
    out = np.array(act_fp8_qdq(x))
    values = np.array(x)
    scale = 2.0 ** np.ceil(np.log2(np.maximum(np.abs(values).max(-1, keepdims=True), 1e-4) / 448))
    scaled = out / scale
    assert (np.abs(scaled) == 448).any()                            # saturation boundary
    assert ((np.abs(scaled) > 0) & (np.abs(scaled) < 2.0 ** -6)).any()  # E4M3 subnormals
    assert ((values != 0) & (out == 0)).any()                       # rounded to zero
    assert np.isin(np.abs(values / scale), MIDPOINTS).sum() > 50    # ties
    assert (np.signbit(out) & (out == 0)).any() and (out < 0).any()


@pytest.mark.parametrize("lead,in_dtype,out_dtype", [
    ((12,), mx.bfloat16, mx.bfloat16), ((2, 3, 2), mx.bfloat16, mx.float32),
    ((7,), mx.float32, mx.float32), ((5,), mx.float16, mx.float16),
    ((24,), mx.float32, mx.bfloat16)])
def test_kernel_equals_ops_bit_for_bit(lead, in_dtype, out_dtype):
    blocks = int(np.prod(lead))
    width = 96 if blocks < 12 else 64
    values = _activations(blocks, blocks * width // 32).reshape(*lead, width)
    if in_dtype == mx.float16:
        values = values * 2.0 ** -12  # within f16's range (the largest block max: 448 x 2^11)
    x = mx.array(values.astype(np.float32)).astype(in_dtype)
    run = ACT_FP8.build(checked)
    _same_bits(run(x, out_dtype, False), act_fp8_qdq(x, out_dtype, False))


@pytest.mark.parametrize("out_dtype", [mx.float32, mx.bfloat16])
def test_products_kernel_equals_ops_bit_for_bit(out_dtype):
    """fp32 products: the activation is their bf16 rounding, taken inside the kernel."""
    values = _products(_activations(7, 40), 7).reshape(2, 5, 128)
    x = mx.array(values)
    run = ACT_FP8.build(checked)
    got, want = run(x, out_dtype, True), act_fp8_qdq(x, out_dtype, True)
    _same_bits(got, want)
    assert not mx.array_equal(want, act_fp8_qdq(x, out_dtype, False)).item()  # rounding matters


def test_dispatcher_keeps_the_ops_where_the_kernel_does_not_apply():
    """Off Metal (this machine) and for shapes the kernel does not take: the ops' results and
    errors; with a built kernel: the kernel."""
    x = mx.array(_activations(3, 4).astype(np.float32)).reshape(2, 64)
    _same_bits(act_fp8(x, mx.bfloat16), act_fp8_qdq(x, mx.bfloat16))
    assert act_fp8(mx.zeros((0, 64)), run=ACT_FP8.build(checked)).shape == (0, 64)
    with pytest.raises(ValueError, match="multiple of the group size 32"):
        act_fp8(mx.zeros((2, 48)), run=ACT_FP8.build(checked))
    calls = []
    act_fp8(x, mx.float32, True, run=lambda *args: calls.append(args) or args[0])
    assert len(calls) == 1 and calls[0][1:] == (mx.float32, True)


@pytest.mark.slow
def test_model_with_the_kernel_equals_the_ops(goldens, tiny_model):
    """The tiny golden model with every act_fp8 through the simulated kernel: the same logits,
    bit for bit, as on the ops; every call site of the decoder stack reaches the kernel."""
    kernel, calls = ACT_FP8.build(metal_kernel), []

    def counted(*args):
        calls.append(args[0].shape)
        return kernel(*args)

    model = tiny_model(Kernels(act_fp8=counted))
    reference = tiny_model(Kernels(use=False))
    ids = goldens("tiny").prompt[None, :12].astype(mx.int32)
    assert mx.array_equal(model(ids), reference(ids)).item()
    layers = len(model.model.layers)
    assert len(calls) >= 7 * layers, (len(calls), layers)  # 91 calls: 7.6 per layer


@pytest.mark.metal
@pytest.mark.skipif(not mx.metal.is_available(), reason="needs a Metal device (macOS)")
def test_act_fp8_kernel_matches_ops_on_device():
    """Apple's compiler and GPU: MLX's kernel (self-checked) against the ops, bit for bit."""
    values = _activations(11, 64).reshape(8, 256)
    with mx.stream(mx.gpu):  # the module runs on the CPU; Metal kernels run on the GPU only
        for is_products, dtype in ((False, mx.bfloat16), (True, mx.float32)):
            x = mx.array(_products(values, 11) if is_products else values.astype(np.float32))
            x = x if is_products else x.astype(mx.bfloat16)
            _same_bits(ACT_FP8.build()(x, dtype, is_products), act_fp8_qdq(x, dtype, is_products))
