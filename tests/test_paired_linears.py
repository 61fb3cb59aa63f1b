"""Paired projections (model/paired.py): two quantized linears that read the same input
(attention `kv_proj` + `q_a_proj`, the shared expert's `gate_proj` + `up_proj`) as ONE quantized
matmul over their weights concatenated along the output axis, two launches fewer per layer on
every path, paired once when the weights are loaded.

It is taken only because it is bit-identical: checked here against the two matmuls for every
mode and layout the converter writes (mxfp8 / mxfp4 / nvfp4 and affine at 2-8 bits and
groups 32-128), at odd widths and row counts, and for the whole model (prefill and decode
logits and caches equal to the model with pairing off). Also: the parameters keep their names
and shapes (the concatenated arrays live outside the module tree and the linears hold views
of them), and weights replaced through `Model.update` / `load_weights` are paired again (never
the stale concatenation)."""

import threading

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from mlx_v41.model import paired
from mlx_v41.model.layers import QuantLinear
from mlx_v41.model.paired import Pair, can_pair, pair_projections, paired_matmul

pytestmark = pytest.mark.usefixtures("cpu")

# (mode, bits, group sizes): convert/recipes.py VALID, the layouts a converted model can hold
LAYOUTS = [("mxfp8", 8, 32), ("mxfp4", 4, 32), ("nvfp4", 4, 16)] + [
    ("affine", bits, group) for bits in (2, 3, 4, 5, 6, 8) for group in (32, 64, 128)]
INPUT_WIDTH = 384  # a multiple of every group size, not a power of two


def linear(output_dims: int, mode: str = "mxfp8", bits: int = 8, group_size: int = 32,
           input_dims: int = INPUT_WIDTH, seed: int = 0) -> QuantLinear:
    """A QuantLinear holding a quantized random weight (rows of very different scales)."""
    module = QuantLinear(input_dims, output_dims, mode, bits, group_size)
    key = mx.random.key(seed)
    w = mx.random.normal((output_dims, input_dims), key=key)
    scale = mx.random.randint(-6, 6, (output_dims, 1), key=mx.random.split(key)[0])
    w = w * mx.power(2.0, scale.astype(mx.float32))
    module.update(dict(zip(("weight", "scales", "biases"),
                           mx.quantize(w, group_size=group_size, bits=bits, mode=mode))))
    return module


class Holder(nn.Module):
    """A module naming its pair, as Attention and SharedExpert do."""

    paired = ("a", "b")

    def __init__(self, first, second):
        super().__init__()
        self.a, self.b = first, second


def paired_up(first, second):
    """The two, paired as the loader pairs them (`pair_projections`)."""
    pair_projections(Holder(first, second))
    return first, second


def separate(first, second, x):
    """The two matmuls as the model ran them before pairing (from the modules' own arrays)."""
    return first.matmul(x), second.matmul(x)


def assert_same_bits(got, want):
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert mx.array_equal(g, w).item()


@pytest.mark.parametrize("mode,bits,group_size", LAYOUTS)
def test_one_matmul_gives_the_two_matmuls_bits(mode, bits, group_size):
    first, second = linear(96, mode, bits, group_size), linear(160, mode, bits, group_size, seed=1)
    key = mx.random.key(2)
    wants = []
    for lead in [(1, 1), (1, 7), (3,), (2, 33)]:  # decode, prefill chunks, a batch
        x = mx.random.normal((*lead, INPUT_WIDTH), key=key)  # fp32, as `prepare` makes it
        x = x * mx.power(2.0, mx.random.randint(-30, 30, (*lead, 1), key=key).astype(x.dtype))
        wants.append((x, separate(first, second, x)))
    paired_up(first, second)
    assert isinstance(first.pair, Pair)  # really one matmul
    for x, want in wants:
        assert_same_bits(paired_matmul(first, second, x), want)
        assert_same_bits(separate(first, second, x), want)  # the views give the same too


def test_parameters_keep_names_shapes_and_values():
    first, second = linear(64, "affine", 4, 64), linear(96, "affine", 4, 64, seed=1)
    holder = Holder(first, second)
    before = dict(tree_flatten(holder.parameters()))
    assert pair_projections(holder) == 1
    after = dict(tree_flatten(holder.parameters()))
    assert sorted(after) == sorted(before) == sorted(
        f"{m}.{n}" for m in "ab" for n in ("weight", "scales", "biases"))
    for k, v in before.items():
        assert after[k].shape == v.shape and after[k].dtype == v.dtype
        assert mx.array_equal(after[k], v).item()
        assert after[k] is not v  # a view of the concatenated array, not a second copy
    assert "pair" not in first  # a plain attribute, not a child in the module tree


def test_pairing_again_reads_the_new_weights():
    """Weights replaced after pairing (what `Model.update` does): pairing again takes them."""
    first, second = paired_up(linear(64), linear(32, seed=1))
    x = mx.random.normal((1, 5, INPUT_WIDTH), key=mx.random.key(3))
    new = linear(64, seed=7)
    first.update({"weight": new.weight, "scales": new.scales})
    paired_up(first, second)
    assert_same_bits(paired_matmul(first, second, x), (new.matmul(x), second.matmul(x)))


def test_unlike_linears_run_apart():
    x = mx.random.normal((2, 3, INPUT_WIDTH), key=mx.random.key(4))
    base = linear(64)
    cases = [linear(64, "mxfp4", 4, 32), linear(64, "affine", 8, 32),
             linear(64, input_dims=INPUT_WIDTH // 2),  # another input width
             linear(40)]  # not whole 32-wide Metal tiles
    unrounded = linear(64)
    unrounded.quantize_input = False
    cases.append(unrounded)

    class Reduced(QuantLinear):  # like distributed/tensor.py's ReducedLinear
        def matmul(self, x):
            return super().matmul(x) * 2.0
    reduced = linear(64)
    reduced.__class__ = Reduced
    cases.append(reduced)
    for other in cases:
        assert not can_pair(base, other) and not can_pair(other, base)
    for other in (cases[0], cases[-1]):  # apart, each as its own matmul
        want = separate(base, other, x)
        paired_up(base, other)
        assert base.pair is None
        assert_same_bits(paired_matmul(base, other, x), want)


def test_second_reading_fewer_rows_runs_apart():
    """q_a reads only the last n_out of n_in rows: two matmuls over their own rows."""
    first, second = linear(64), linear(32, seed=1)
    x = mx.random.normal((1, 6, INPUT_WIDTH), key=mx.random.key(5))
    want = (first.matmul(x), second.matmul(x[:, 4:]))
    paired_up(first, second)
    assert_same_bits(paired_matmul(first, second, x, 2), want)
    assert paired_matmul(first, second, x, 0)[1].shape == (1, 0, 32)


def test_a_pair_made_on_one_thread_serves_another():
    """The server runs forwards on a worker thread: pairs made at load on the main thread,
    then on the worker a paired call and one whose second linear reads fewer rows (two
    matmuls over the linears' views). MLX refuses to evaluate an array made on another
    thread's stream ('There is no Stream(cpu, 0) in current thread'), so the pair's arrays
    and views are evaluated when it is made."""
    first, second = linear(64), linear(32, seed=1)
    x = mx.random.normal((1, 6, INPUT_WIDTH), key=mx.random.key(5))
    mx.eval(x, first.parameters(), second.parameters())
    wants = {rows: (first.matmul(x), second.matmul(x[:, 6 - rows:])) for rows in (6, 2)}
    mx.eval(wants)
    paired_up(first, second)
    results = []

    def on_worker():
        try:
            for rows, want in wants.items():
                got = paired_matmul(first, second, x, rows)
                results.append(all(mx.array_equal(g, w).item() for g, w in zip(got, want)))
        except RuntimeError as error:
            results.append(error)

    worker = threading.Thread(target=on_worker)
    worker.start()
    worker.join()
    assert results == [True, True]


def test_inside_compile_tracing():
    """A paired call traced by `mx.compile`: the two matmuls' bits inside and after it."""
    first, second = linear(64), linear(32, seed=1)
    x = mx.random.normal((1, 3, INPUT_WIDTH), key=mx.random.key(6))
    want = (first.matmul(x), second.matmul(x))
    paired_up(first, second)
    assert_same_bits(mx.compile(lambda v: paired_matmul(first, second, v))(x), want)
    assert_same_bits(paired_matmul(first, second, x), want)


def test_rows_are_required():
    with pytest.raises(ValueError, match="rows"):
        paired_matmul(linear(32), linear(32), mx.ones((INPUT_WIDTH,)))


def test_metal_kernel_classes():
    same = paired._same_metal_kernel
    assert same(5120, (512, 1280)) and same(5120, (2304, 2304))  # the published widths
    assert same(5120, (288, 288)) and same(128, (64, 64))  # 8-rank shared expert; tiny
    assert not same(1024, (2048, 64))  # the sum crosses Metal's 2048 qmv class
    assert not same(1024, (40, 72))  # not whole tiles


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model()


def _run(model, ids):
    """Logits of a prefill (every position) and two decode steps, and the cache arrays."""
    cache = model.make_cache()
    out = [model.prefill(ids, cache, last_only=False)]
    for token in (3, 4):
        out.append(model(mx.array([[token]], dtype=mx.int32), cache=cache))
    out += [a for layer in cache for a in layer.state]
    mx.eval(out)
    return out


def test_model_bits_equal_unpaired(tiny, goldens, monkeypatch):
    """The loaded model is paired (every layer's two pairs); its logits and caches equal the
    model with pairing off. (A difference below a product's bf16 rounding could pass here:
    the bit-level checks are the ones above.)"""
    ids = goldens("tiny").prompt[None, :12].astype(mx.int32)
    names = {k: v.shape for k, v in tree_flatten(tiny.parameters())}
    stages = len(tiny.dspark.stages) if "dspark" in tiny else 0  # their shared experts
    assert tiny.pairs == 2 * len(tiny.model.layers) + stages
    for layer in tiny.model.layers:
        assert isinstance(layer.self_attn.kv_proj.pair, Pair)
        assert isinstance(layer.mlp.shared_experts.gate_proj.pair, Pair)
    with_pairs = _run(tiny, ids)
    assert {k: v.shape for k, v in tree_flatten(tiny.parameters())} == names
    monkeypatch.setattr(paired, "can_pair", lambda first, second: False)
    assert tiny.pair_projections() == 0
    apart = _run(tiny, ids)
    for a, b in zip(with_pairs, apart):
        assert mx.array_equal(a, b).item()


def test_model_update_after_a_forward_is_used(tiny, goldens, tiny_model):
    """Swap two layers' kv / q_a / shared-expert weights after a forward: the next forward
    equals a model that had them before its first."""
    ids = goldens("tiny").prompt[None, :6].astype(mx.int32)
    _run(tiny, ids)
    swapped = {}
    params = dict(tree_flatten(tiny.parameters()))
    for name in ("self_attn.kv_proj", "self_attn.q_a_proj", "mlp.shared_experts.up_proj"):
        for n in ("weight", "scales"):
            swapped[f"model.layers.0.{name}.{n}"] = params[f"model.layers.1.{name}.{n}"]
    tiny.load_weights(list(swapped.items()), strict=False)
    fresh = tiny_model()
    fresh.load_weights(list(swapped.items()), strict=False)
    for a, b in zip(_run(tiny, ids), _run(fresh, ids)):
        assert mx.array_equal(a, b).item()
