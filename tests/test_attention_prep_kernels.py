"""The attention-prep kernels through the Metal simulator (races and coverage checked) against
their ops: window_rows (metal/window_rows.metal: the SWA ring's decoded rows + the call's new
rows in one launch) bit for bit, as its decode is exact; rope_products (metal/rope_products.metal:
bf16 rounding of the query products + RoPE) and index_queries (metal/index_queries.metal: the
same + fp4_e8m0 fake-quant) within their stated tolerances (rope_products 2^-7, index_queries
0.75 of the largest value with at most 1/256 of the values differing: what a fused multiply-add
on the GPU may flip). Measured through the simulator, which keeps each product rounded: an error
of 0 on every case below, ties, bf16 rounding ties of the products, E2M1 midpoints, scale edges,
subnormals and zero blocks included, so these tests ask for the ops' bits. Then the self-checks'
fallback, and the tiny golden model with the kernels against its ops: the same logits (measured
difference 0) over a two-chunk prefill and two decode steps."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_v41.kernels import Kernels
from mlx_v41.kernels.context import using
from mlx_v41.kernels.index_queries import (CHECK_TOLERANCE as INDEX_TOLERANCE, INDEX_QUERIES,
                                           index_queries, index_queries_ops)
from mlx_v41.kernels.rope_products import (CHECK_TOLERANCE as ROPE_TOLERANCE, ROPE_PRODUCTS,
                                           rope_products, rope_products_ops)
from mlx_v41.kernels.swa_ring import swa_ring_update_ops
from mlx_v41.kernels.window_rows import (WINDOW_ROWS, stacked_window_rows_ops, window_rows,
                                        window_rows_ops)
from mlx_v41.numerics.rope import RoPE
from tests.kernel_faults import (checked, not_compiling, returning, sim, warnings_of,
                                zeros)

pytestmark = pytest.mark.usefixtures("cpu")

YARN = {"original_max_position_embeddings": 65536, "factor": 16.0, "beta_fast": 32,
        "beta_slow": 1}
E2M1_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def _same_bits(got: mx.array, want: mx.array) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype == mx.bfloat16
    g, w = np.array(got.view(mx.uint16)), np.array(want.view(mx.uint16))
    differ = g != w
    assert not differ.any(), (int(differ.sum()), np.argwhere(differ)[:4])


def _window_values(rng, shape) -> np.ndarray:
    """Rows whose act_fp8 blocks span scales 2^-40 .. 2^20, with zero and -0 blocks."""
    blocks = rng.standard_normal(shape[:-1] + (shape[-1] // 32, 32))
    blocks *= 2.0 ** rng.integers(-40, 20, blocks.shape[:-1] + (1,))
    blocks[..., ::5, :, :] *= 0.0
    blocks[..., 1::7, :1, :] = -0.0
    return blocks.reshape(shape)


@pytest.mark.parametrize("batch,capacity,width,position,count,fresh,skip", [
    (1, 8, 64, 17, 5, 2, 1),       # across the ring's end, first row left out
    (2, 32, 96, 40, 15, 1, 0),     # a decode step (window 16)
    (2, 32, 32, 100, 15, 7, 6),    # a prefill chunk whose queries need fewer rows
    (1, 16, 64, 3, 3, 4, 0),       # every position held so far
    (1, 8, 32, 9, 8, 3, 10)])      # only new rows kept
def test_window_rows_kernel_equals_ops_bit_for_bit(batch, capacity, width, position, count,
                                                   fresh, skip):
    rng = np.random.default_rng(position)
    history = mx.array(_window_values(rng, (batch, position, width)).astype(np.float32))
    ring = swa_ring_update_ops(mx.zeros((batch, capacity, width * 33 // 32), mx.uint8),
                               history.astype(mx.bfloat16), 0)
    rows = mx.array(_window_values(rng, (batch, fresh, width)).astype(np.float32))
    rows = rows.astype(mx.bfloat16)
    got = window_rows(ring, rows, position, count, skip, run=WINDOW_ROWS.build(checked))
    _same_bits(got, window_rows_ops(ring, rows, position, count, skip))
    assert got.shape == (batch, count + fresh - skip, width)


def test_window_rows_dispatcher():
    """No ring rows: the new rows' slice, no launch; rows it does not take: the ops; bad
    counts: one clear error."""
    ring = mx.zeros((1, 8, 66), mx.uint8)
    rows = mx.ones((1, 3, 64), mx.bfloat16)

    def never(*_):
        raise AssertionError("launched")

    assert mx.array_equal(window_rows(ring, rows, 4, 0, 1, run=never), rows[:, 1:]).item()
    assert window_rows(ring, rows.astype(mx.float32), 4, 2, run=never).dtype == mx.float32
    with pytest.raises(ValueError, match="cannot read 5 ring rows before position 4"):
        window_rows(ring, rows, 4, 5)


def _filled_ring(rng, batch, capacity, width) -> mx.array:
    """A packed ring [B, R, D + D/32] whose every slot holds a row of `_window_values` (a
    different one in each batch row and slot)."""
    values = mx.array(_window_values(rng, (batch, capacity, width)).astype(np.float32))
    return swa_ring_update_ops(mx.zeros((batch, capacity, width * 33 // 32), mx.uint8),
                               values.astype(mx.bfloat16), 0)


# B rows, each at its own position: before the ring has wrapped, across its end, far beyond
# (several ring lengths); decode (S = 1) and chunks, S == R; count 0 and count = the least
# min(position, R) over the rows.
MIXED_WINDOW_CASES = [
    (8, 64, 1, (5,), 5, 0),                      # B = 1, count = position
    (8, 64, 1, (3, 7), 3, 0),                    # decode before the wrap, count = min
    (8, 32, 3, (9, 4, 17), 4, 2),                # across the end, before the wrap; skip
    (8, 64, 2, (8, 30, 100, 0), 0, 0),           # count 0 (position 0 too): the new rows only
    (16, 96, 1, (16, 50, 16 * 6 + 5, 31, 20), 15, 0),  # B = 5 decode (window 16), far beyond
    (8, 32, 8, (8, 9, 40, 13, 70), 8, 3),        # S == R, count = R
    (8, 64, 3, (2, 9, 5), 2, 4),                 # count = min, skip into the new rows
]


@pytest.mark.parametrize("capacity,width,fresh,positions,count,skip", MIXED_WINDOW_CASES)
def test_window_rows_mixed_rows_bit_for_bit(capacity, width, fresh, positions, count, skip):
    """Batch rows at their own positions in one launch (races and coverage checked): the bits
    of the stacked ops, and row b those of a batch-1 call at positions[b]."""
    batch = len(positions)
    rng = np.random.default_rng(sum(positions) + count)
    ring = _filled_ring(rng, batch, capacity, width)
    rows = mx.array(_window_values(rng, (batch, fresh, width)).astype(np.float32))
    rows = rows.astype(mx.bfloat16)
    run = WINDOW_ROWS.build(checked)
    got = run(ring, rows, positions, count, skip)  # the kernel itself, count 0 included
    assert got.shape == (batch, count + fresh - skip, width)
    stacked = stacked_window_rows_ops(ring, rows, positions, count) if count else rows
    _same_bits(got, stacked[:, skip:])
    _same_bits(got, window_rows_ops(ring, rows, positions, count, skip))
    each = [window_rows_ops(ring[b:b + 1], rows[b:b + 1], p, count, skip)
            for b, p in enumerate(positions)]
    _same_bits(got, mx.concatenate(each))
    for given in (positions, list(positions), mx.array(positions, mx.int32),
                  mx.array(positions, mx.int64)):  # the dispatcher, any form of the positions
        _same_bits(window_rows(ring, rows, given, count, skip, run=run), got)
    if skip < count and len(set(positions)) > 1:  # row 0's position for all: other bits
        assert not mx.array_equal(got, window_rows_ops(ring, rows, positions[0], count,
                                                       skip)).item()


# Rows whose window is still filling (position < count) beside full ones: decode, a chunk with
# a skip, position 0, count = R.
FILLING_WINDOW_CASES = [
    (8, 64, 1, (0, 3, 12), 7, 0),
    (16, 32, 3, (2, 15, 40), 15, 5),
    (8, 64, 2, (5, 1, 0, 30), 8, 0),
]


@pytest.mark.parametrize("capacity,width,fresh,positions,count,skip", FILLING_WINDOW_CASES)
def test_window_rows_filling_rows_read_zeros_before_position_0(capacity, width, fresh,
                                                              positions, count, skip):
    """A row whose position is below `count` gets zero rows for the positions before 0, then
    the bits of its own batch-1 call over the rows it holds: one launch (races and coverage
    checked) and the stacked ops alike."""
    batch = len(positions)
    rng = np.random.default_rng(sum(positions) + count)
    ring = _filled_ring(rng, batch, capacity, width)  # every slot written: zeros must be made
    rows = mx.array(_window_values(rng, (batch, fresh, width)).astype(np.float32))
    rows = rows.astype(mx.bfloat16)
    got = window_rows(ring, rows, positions, count, skip, run=WINDOW_ROWS.build(checked))
    _same_bits(got, window_rows_ops(ring, rows, positions, count, skip))
    for b, position in enumerate(positions):
        held = min(position, count)
        own = window_rows_ops(ring[b:b + 1], rows[b:b + 1], position, held, 0)
        zeros = mx.zeros((1, count - held, width), mx.bfloat16)
        _same_bits(got[b:b + 1], mx.concatenate([zeros, own], axis=1)[:, skip:])


def test_window_rows_per_row_dispatcher():
    """Per-row positions without the kernel: the stacked ops; with one: a single launch; count
    0: the new rows' slice, no launch; bad per-row input: a one-line ValueError naming the
    problem."""
    rng = np.random.default_rng(11)
    ring = _filled_ring(rng, 3, 8, 64)
    rows = mx.array(_window_values(rng, (3, 2, 64)).astype(np.float32)).astype(mx.bfloat16)
    positions = (6, 3, 29)
    want = stacked_window_rows_ops(ring, rows, positions, 3)[:, 1:]
    for given in (positions, list(positions), mx.array(positions, mx.int64)):
        _same_bits(window_rows(ring, rows, given, 3, 1, use_kernel=False), want)
    calls = []

    def counted(*args):
        calls.append(args[2])
        return WINDOW_ROWS.build(sim)(*args)

    _same_bits(window_rows(ring, rows, mx.array(positions), 3, 1, run=counted), want)
    assert calls == [positions]

    def never(*_):
        raise AssertionError("launched")

    assert mx.array_equal(window_rows(ring, rows, positions, 0, 1, run=never),
                          rows[:, 1:]).item()
    wide = window_rows(ring, rows.astype(mx.float32), positions, 3, run=never)
    assert mx.array_equal(wide, stacked_window_rows_ops(ring, rows.astype(mx.float32),
                                                        positions, 3)).item()
    for bad, count, problem in [((6, 3), 2, "2 positions for 3 batch rows"),
                                ((6, -1, 29), 0, "position -1 of row 1"),
                                ((20, 30, 40), 9, "position 20 of row 0 \\(a ring of 8"),
                                (mx.array([1.0, 2.0, 3.0]), 0, "int32 or int64 array")]:
        with pytest.raises(ValueError, match=problem) as error:
            window_rows(ring, rows, bad, count, use_kernel=False)
        assert "\n" not in str(error.value)


def test_window_rows_self_check_passes_in_the_simulator():
    """The self-check (an int and a two-row per-row call) keeps the simulated kernel."""
    run, messages = warnings_of(WINDOW_ROWS.build_checked, checked)
    assert run is not window_rows_ops and not messages, messages


def _products(rng, shape, rotated: int, tiny: bool = True) -> np.ndarray:
    """fp32 products: bf16 rounding ties, E2M1 midpoints x 2^k before the rotated tail (the
    FP4 rounding's ties, block maxima at 6 x 2^k and just above), wide magnitudes, a zero head,
    -0 and (`tiny`) a head below the FP4 scale's floor, bf16 subnormals included."""
    x = rng.standard_normal(shape) * 2.0 ** rng.integers(-30, 30, shape[:-1] + (1,))
    plain = shape[-1] - rotated
    scale = 2.0 ** rng.integers(-20, 20, shape[:-1] + (1,))
    x[..., :plain] = rng.choice(E2M1_MIDPOINTS, shape[:-1] + (plain,)) * scale
    x[..., :plain] *= rng.choice([-1.0, 1.0], shape[:-1] + (plain,))
    x[..., 0] = 6.0 * scale[..., 0] * rng.choice([1.0, 1 + 2.0 ** -6], shape[:-1])
    x[..., 1, :] = 0.0
    x[..., 0, 1] = -0.0
    if tiny:
        x[..., 2, :] = rng.standard_normal(shape[:2] + shape[-1:]) * 2.0 ** -128
    x = x.astype(np.float32)
    ties = (x.view(np.uint32) & np.uint32(0xFFFF0000)) | np.uint32(0x8000)  # bf16 halfway
    return np.where(rng.random(shape) < 0.3, ties.view(np.float32), x)


CASES = [((1, 1, 4, 64), 16, 7), ((2, 3, 3, 64), 16, 1 << 20),
         ((1, 2, 5, 96), 32, "array"), ((1, 1, 64, 128), 64, 123457)]


def _positions(positions, length):
    if positions == "array":
        return mx.array([3, 70000, 5][:length])
    return positions


@pytest.mark.parametrize("shape,rope_dim,positions", CASES + [((2, 2, 3, 48), 16, 9)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_rope_products_kernel_matches_ops(shape, rope_dim, positions, dtype):
    rng = np.random.default_rng(shape[-1] + rope_dim)
    x = mx.array(_products(rng, shape, rope_dim)).astype(dtype)
    rope, positions = RoPE(rope_dim, 160000.0, YARN), _positions(positions, shape[1])
    got = rope_products(x, rope, positions, run=ROPE_PRODUCTS.build(checked))
    want = rope_products_ops(x, rope, positions)
    error = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
    assert error <= ROPE_TOLERANCE * mx.abs(want.astype(mx.float32)).max().item()
    _same_bits(got, want)  # the simulator rounds every product: measured error 0


@pytest.mark.parametrize("shape,rope_dim,positions", CASES)
def test_index_queries_kernel_matches_ops(shape, rope_dim, positions):
    rng = np.random.default_rng(shape[-1] * 3 + rope_dim)
    x = mx.array(_products(rng, shape, rope_dim))
    rope, positions = RoPE(rope_dim, 10000.0), _positions(positions, shape[1])
    got = index_queries(x, rope, positions, run=INDEX_QUERIES.build(checked))
    want = index_queries_ops(x, rope, positions)
    error = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
    assert error <= INDEX_TOLERANCE * mx.abs(want.astype(mx.float32)).max().item()
    _same_bits(got, want)


def test_the_index_inputs_reach_the_fp4_edge_cases():
    """The products above meet E2M1 ties, block maxima exactly at and just above 6 x 2^k,
    bf16 rounding ties and zero blocks (so a kernel that mishandles one cannot pass)."""
    rng = np.random.default_rng(1)
    x = _products(rng, (2, 3, 3, 64), 16)
    values = np.array(mx.array(x).astype(mx.bfloat16).astype(mx.float32))
    blocks = values[..., :32]
    scale = 2.0 ** np.ceil(np.log2(np.abs(blocks).max(-1, keepdims=True).clip(1e-30) / 6))
    assert np.isin(np.abs(blocks / scale), E2M1_MIDPOINTS).sum() > 100
    assert (np.abs(blocks).max(-1) / scale[..., 0] == 6).any()
    assert ((x.view(np.uint32) & 0xFFFF) == 0x8000).mean() > 0.2
    assert (np.abs(values).max(-1) == 0).any()


def test_dispatchers_keep_the_ops_where_the_kernels_do_not_apply():
    """Odd widths and mismatched positions: the ops (and their errors)."""
    rope, run = RoPE(16, 10000.0), INDEX_QUERIES.build(sim)
    with pytest.raises(ValueError, match="multiple of the group size 32"):
        index_queries(mx.ones((1, 1, 2, 48)), rope, 0, run=run)
    x = mx.ones((1, 2, 2, 33))
    with pytest.raises(ValueError):
        rope_products(x, rope, 0, run=ROPE_PRODUCTS.build(sim))
    x = mx.ones((1, 2, 2, 32))
    assert mx.array_equal(rope_products(x, rope, mx.arange(2), use_kernel=False),
                          rope_products_ops(x, rope, mx.arange(2))).item()


# Batch rows each from its own first position (row b at first[b] .. first[b] + S - 1): B 1 to
# 5, first positions 0, small and beyond YaRN's original 65536, S = 1 (decode) and S > 1.
ROW_CASES = [(1, (0,)), (1, (70001,)), (3, (0, 7, 70001)), (2, (65535, 3)), (3, (131075, 0, 9)),
             (2, (5, 100000)), (5, (0, 1, 65536, 65540, 12)), (5, (99999, 0, 0, 4, 200000))]
ROW_FORMS = {"tuple": tuple, "list": list,
             "array": lambda firsts: mx.array(firsts, dtype=mx.int32)[:, None]}


def _counting(factory, calls: list):
    """`factory`'s kernels, each launch appended to `calls`."""
    def count(outputs):
        calls.append(1)
        return outputs
    return returning(count, factory, "counting")


def _per_row_matches(dispatcher, ops, spec, x, rope, firsts, form, tolerance):
    """`dispatcher` at per-row `firsts` (as `form`) in one launch: within `tolerance` of the ops
    at the tuple, and the ops' bits (the simulator rounds every product); each row b the bits
    of a batch-1 kernel call at first[b]."""
    calls = []
    got = dispatcher(x, rope, ROW_FORMS[form](firsts), run=spec.build(_counting(checked, calls)))
    assert len(calls) == 1
    want = ops(x, rope, firsts)
    error = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
    assert error <= tolerance * mx.abs(want.astype(mx.float32)).max().item()
    _same_bits(got, want)
    run = spec.build(checked)
    for b, first in enumerate(firsts):
        _same_bits(got[b:b + 1], dispatcher(x[b:b + 1], rope, first, run=run))


@pytest.mark.parametrize("length", [1, 3])
@pytest.mark.parametrize("rows,firsts", ROW_CASES)
def test_rope_products_kernel_per_row_positions(rows, firsts, length):
    rng = np.random.default_rng(rows * 10 + length)
    x = mx.array(_products(rng, (rows, length, 3, 64), 32))
    form = ("tuple", "list", "array")[(rows + length) % 3]
    _per_row_matches(rope_products, rope_products_ops, ROPE_PRODUCTS, x,
                     RoPE(32, 160000.0, YARN), firsts, form, ROPE_TOLERANCE)


@pytest.mark.parametrize("length", [1, 2])
@pytest.mark.parametrize("rows,firsts", ROW_CASES)
def test_index_queries_kernel_per_row_positions(rows, firsts, length):
    rng = np.random.default_rng(rows * 10 + length + 1)
    x = mx.array(_products(rng, (rows, length, 3, 64), 16))
    form = ("array", "tuple", "list")[(rows + length) % 3]
    _per_row_matches(index_queries, index_queries_ops, INDEX_QUERIES, x,
                     RoPE(16, 160000.0, YARN), firsts, form, INDEX_TOLERANCE)


@pytest.mark.parametrize("form", sorted(ROW_FORMS))
def test_per_row_positions_every_form(form):
    """A tuple, a list and a [B, 1] array of first positions give the same bits, through the
    kernels and with `use_kernel=False` (the ops at the tuple)."""
    rng = np.random.default_rng(4)
    x = mx.array(_products(rng, (3, 2, 3, 64), 32))
    rope, firsts = RoPE(32, 160000.0, YARN), (70000, 0, 11)
    for dispatcher, ops, spec in ((rope_products, rope_products_ops, ROPE_PRODUCTS),
                                  (index_queries, index_queries_ops, INDEX_QUERIES)):
        want = ops(x, rope, firsts)
        _same_bits(dispatcher(x, rope, ROW_FORMS[form](firsts), run=spec.build(sim)), want)
        _same_bits(dispatcher(x, rope, ROW_FORMS[form](firsts), use_kernel=False), want)
        _same_bits(ops(x, rope, ROW_FORMS[form](firsts)), want)


def test_per_row_positions_of_the_wrong_count_raise():
    """Per-row positions that are not one first position per batch row: one line naming them."""
    x, rope = mx.ones((2, 1, 3, 64)), RoPE(16, 10000.0)
    for dispatcher, spec in ((rope_products, ROPE_PRODUCTS), (index_queries, INDEX_QUERIES)):
        name = spec.field
        for run in (spec.build(sim), None):
            with pytest.raises(ValueError, match=f"^{name}: positions holds 3 first positions "
                                                 "for 2 batch rows$"):
                dispatcher(x, rope, (1, 2, 3), run=run)
            with pytest.raises(ValueError, match=rf"^{name}: per-row positions must be an "
                                                 r"integer array \[2, 1\]"):
                dispatcher(x, rope, mx.array([[1], [2], [3]]), run=run)
        with pytest.raises(ValueError, match=r"^[^\n]*$"):
            dispatcher(x, rope, [4], use_kernel=False)


@pytest.mark.parametrize("factory,reason", [(not_compiling(), "MetalCompileError"),
                                            (zeros, "KernelMismatch")])
@pytest.mark.parametrize("build,ops,name", [
    (WINDOW_ROWS.build_checked, window_rows_ops, "v41_window_rows"),
    (ROPE_PRODUCTS.build_checked, rope_products_ops, "v41_rope_products"),
    (INDEX_QUERIES.build_checked, index_queries_ops, "v41_index_queries")])
def test_a_broken_kernel_warns_once_and_runs_its_ops(factory, reason, build, ops, name):
    run, messages = warnings_of(build, factory)
    assert run is ops
    assert len(messages) == 1 and name in messages[0] and reason in messages[0], messages


def test_indexer_reads_the_attentions_rounded_queries(goldens, tiny_model):
    """`Indexer.queries` on the attention's `q_b_proj.prepare(qr)` (the same act_fp8 values)
    equals its own rounding of qr."""
    model = tiny_model()
    attention = model.model.layers[2].self_attn
    rng = np.random.default_rng(2)
    x = mx.array(rng.standard_normal((1, 3, 128)).astype(np.float32)).astype(mx.bfloat16)
    qr = mx.array(rng.standard_normal((1, 3, 64)).astype(np.float32)).astype(mx.bfloat16)
    own = attention.indexer.queries(x, qr, 5, attention.rope)
    shared = attention.indexer.queries(x, qr, 5, attention.rope,
                                       qr_fp8=attention.q_b_proj.prepare(qr))
    for a, b in zip(own, shared):
        assert mx.array_equal(a, b).item()


def test_query_rope_on_a_model_layer(tiny_model):
    """The tiny golden's layer-2 queries (YaRN RoPE) from their products, as the attention
    computes them today (`rope(q_b_proj(qr))`): the same bits."""
    model = tiny_model()
    attention = model.model.layers[2].self_attn
    qr = mx.array(np.random.default_rng(3).standard_normal((2, 3, 64)).astype(np.float32))
    qr = qr.astype(mx.bfloat16)
    shape = (2, 3, attention.heads, attention.head_dim)
    products = attention.q_b_proj.matmul(attention.q_b_proj.prepare(qr)).reshape(shape)
    with using(Kernels(rope_products=ROPE_PRODUCTS.build(checked))):
        got = rope_products(products, attention.rope, 70)
    _same_bits(got,
               attention.rope(attention.q_b_proj(qr).reshape(shape), 70))


@pytest.mark.slow
def test_model_with_the_kernels_equals_the_ops(goldens, tiny_model):
    """The tiny golden model with window_rows and index_queries through the simulator (each
    call counted): the ops' logits over a two-chunk prefill and two decode steps (measured
    difference 0: both kernels give the ops' bits here)."""
    calls = {"window_rows": 0, "index_queries": 0}

    def counted(name, run):
        def call(*args):
            calls[name] += 1
            return run(*args)
        return call

    model = tiny_model(Kernels(window_rows=counted("window_rows", WINDOW_ROWS.build(sim)),
                               index_queries=counted("index_queries", INDEX_QUERIES.build(sim))))
    reference = tiny_model(Kernels(use=False))
    ids = goldens("tiny").prompt[None, :14].astype(mx.int32)
    caches = model.make_cache(), reference.make_cache()
    for chunk in (ids[:, :8], ids[:, 8:12], ids[:, 12:13], ids[:, 13:14]):
        got, want = (m(chunk, cache=c) for m, c in zip((model, reference), caches))
        assert mx.array_equal(got, want).item()
    layers = len(model.model.layers)
    assert calls["window_rows"] == 3 * layers, calls  # every call after the first
    assert calls["index_queries"] >= 4 * 4, calls     # the indexer layers, every call


@pytest.mark.metal
@pytest.mark.skipif(not mx.metal.is_available(), reason="needs a Metal device (macOS)")
def test_attention_prep_kernels_match_ops_on_device():
    """Apple's compiler and GPU: MLX's kernels (self-checked) against the ops."""
    rng = np.random.default_rng(5)
    with mx.stream(mx.gpu):  # the module runs on the CPU; Metal kernels run on the GPU only
        history = mx.array(_window_values(rng, (1, 40, 512)).astype(np.float32))
        ring = swa_ring_update_ops(mx.zeros((1, 32, 528), mx.uint8), history, 0)
        rows = mx.array(_window_values(rng, (1, 1, 512)).astype(np.float32)).astype(mx.bfloat16)
        _same_bits(WINDOW_ROWS.build()(ring, rows, 40, 15, 0),
                   window_rows_ops(ring, rows, 40, 15, 0))
        x = mx.array(_products(rng, (1, 2, 64, 128), 64, tiny=False))
        rope = RoPE(64, 160000.0, YARN)
        got, want = ROPE_PRODUCTS.build()(x, rope, 900), rope_products_ops(x, rope, 900)
        error = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
        assert error <= ROPE_TOLERANCE * mx.abs(want.astype(mx.float32)).max().item()
        got, want = INDEX_QUERIES.build()(x, rope, 900), index_queries_ops(x, rope, 900)
        assert (got != want).sum().item() <= want.size / 256
