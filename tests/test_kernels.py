"""The three Metal kernels (FP4 pack, SWA ring update, fused sparse attention) run in the MSL
simulator against their `*_ops` references on odd shapes and adversarial values, plus the
dispatchers' CPU fallback. Bytes and ring rows must match exactly; attention within the bounds
stated at `assert_attention_close`. The simulator runs on the host and the ops on the CPU backend
(the `cpu` fixture); tests marked `metal` need a real device and run kernels and ops on its GPU.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np
import pytest

from mlx_v41.kernels import fp4_pack as fp4_mod
from mlx_v41.kernels import sparse_attention as attn_mod
from mlx_v41.kernels import swa_ring as ring_mod
from mlx_v41.numerics.fp8_activation import act_fp8_qdq
from mlx_v41.numerics.quant import (e4m3_to_float, float_to_e4m3, fp4_e4m3_qdq, fp4_e8m0_qdq,
                                 pack_fp4_e4m3, unpack_fp4_e4m3, unpack_fp4_e8m0, unpack_fp8_e8m0)
from tests.kernel_faults import checked, sim  # sim: strict, poisoned outputs

has_metal = pytest.mark.skipif(not mx.metal.is_available(), reason="needs a Metal device (macOS)")
pytestmark = pytest.mark.usefixtures("cpu")
F32 = np.float32


def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def bits(x: mx.array) -> np.ndarray:
    """Bit patterns, so that NaN payloads and -0 compare exactly."""
    view = {mx.bfloat16: mx.uint16, mx.float16: mx.uint16, mx.float32: mx.uint32}[x.dtype]
    return np.array(x.view(view))


@functools.cache
def pack_kernel(options="sim"):
    return fp4_mod.FP4_PACK.build(checked if options == "checked" else sim)


@functools.cache
def ring_kernel(options="sim"):
    return ring_mod.SWA_RING_UPDATE.build(checked if options == "checked" else sim)


@functools.cache
def attention_kernel(options="sim"):
    return attn_mod.SPARSE_ATTENTION.build(checked if options == "checked" else sim)


# ------------------------------------------------------------------------------ FP4 pack
E2M1_TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E4M3_VALUES = np.array(e4m3_to_float(mx.arange(0, 127).astype(mx.uint8)), dtype=F32)


def _ties_group(group: int, scale: float) -> np.ndarray:
    """Every E2M1 tie, both signs, with amax = 6 * scale, so x / s lands exactly on each tie."""
    ties = [6.0, -6.0] + [v for t in E2M1_TIES for v in (t, -t)]
    ties += [0.0, -0.0, 0.5, -1.0, 3.0, -4.0, 1.5, -2.0, 6.0, -0.5, 2.0, 4.0, -1.5, -3.0,
             0.0, -0.0][: group - len(ties)]
    return np.array(ties[:group], dtype=F32) * F32(scale)


def _scale_boundaries(kind: str) -> np.ndarray:
    """Group maxima on and one ulp around every scale decision point of the format."""
    if kind == "kv":  # E4M3(amax / 6) changes code at 6 x the midpoints of E4M3 values
        points = F32(3) * (E4M3_VALUES[:-1] + E4M3_VALUES[1:])
    else:             # ceil(log2(amax * (1/6))) changes at amax ~ 6 * 2^k
        points = F32(6) * (F32(2.0) ** np.arange(-120, 100, 7).astype(F32))
    near = [np.nextafter(points, F32(0)), points, np.nextafter(points, F32(np.inf))]
    return np.concatenate(near).astype(F32)


def adversarial_groups(kind: str, seed: int = 0) -> np.ndarray:
    """[N, group] fp32: ties at several exact scales, one-ulp neighbours of the decision
    products t*s, scale boundaries, saturation, zeros, -0, tiny and subnormal-scale groups."""
    group = fp4_mod.KINDS[kind][0]
    r = rng(seed)
    if kind == "kv":
        scales = [1.0, 0.375, 2.0 ** -9, 0.0390625, 448.0]
    else:
        scales = [1.0, 2.0 ** -20, 2.0 ** 30]
    groups = [_ties_group(group, s) for s in scales]
    for s in scales[:3]:  # neighbours of t*s: x / s rounds onto t only from exactly t*s
        t = np.resize(np.array(E2M1_TIES, dtype=F32) * F32(s), group - 1)
        for direction in (0.0, np.inf):
            groups.append(np.concatenate([[F32(6 * s)], np.nextafter(t, F32(direction))]))
    for amax in _scale_boundaries(kind):
        g = r.uniform(-1, 1, group).astype(F32) * amax
        g[r.integers(group)] = amax * (1 if r.random() < 0.5 else -1)
        groups.append(g)
    special = [np.full(group, 0.0), np.full(group, -0.0), np.full(group, 1e-6),
               np.full(group, -1e-30), np.full(group, 3e-39), np.full(group, 2688.0),
               np.full(group, 3.0e38), np.linspace(-0.05, 0.05, group),
               np.linspace(-3000.0, 20.0, group)]
    groups += [np.asarray(g, dtype=F32) for g in special]
    return np.stack(groups).astype(F32)


def as_rows(groups: np.ndarray, width: int) -> np.ndarray:
    per_row = width // groups.shape[1]
    pad = (-groups.shape[0]) % per_row
    filler = rng(1).standard_normal((pad, groups.shape[1])).astype(F32)
    return np.concatenate([groups, filler]).reshape(-1, width)


@pytest.mark.parametrize("kind, width", [("kv", 16), ("kv", 64), ("kv", 512), ("index", 32),
                                         ("index", 128)])
def test_fp4_pack_random_rows_bit_exact(kind, width):
    run = pack_kernel()
    r = rng(width)
    for dtype, lead in ((mx.bfloat16, (7,)), (mx.float16, (3,)), (mx.float32, (2, 5))):
        x = mx.array(r.standard_normal(lead + (width,)).astype(F32) * 4).astype(dtype)
        got, want = run(x, kind), fp4_mod.fp4_pack_ops(x, kind)
        assert got.shape == want.shape == lead + (fp4_mod.packed_width(width, kind),)
        np.testing.assert_array_equal(np.array(got), np.array(want))


@pytest.mark.parametrize("kind", ["kv", "index"])
def test_fp4_pack_adversarial_rows_bit_exact(kind):
    groups = adversarial_groups(kind)
    x = mx.array(as_rows(groups, 64 if kind == "kv" else 96))
    got = pack_kernel("checked")(x, kind)
    np.testing.assert_array_equal(np.array(got), np.array(fp4_mod.fp4_pack_ops(x, kind)))
    # decode(kernel bytes) is the spec's QDQ value bit for bit
    unpack, qdq = ((unpack_fp4_e4m3, fp4_e4m3_qdq) if kind == "kv"
                   else (unpack_fp4_e8m0, fp4_e8m0_qdq))
    np.testing.assert_array_equal(bits(unpack(got, mx.float32)), bits(qdq(x)))
    # bf16 inputs too (ties and saturation survive the cast)
    xb = x.astype(mx.bfloat16)
    np.testing.assert_array_equal(np.array(pack_kernel()(xb, kind)),
                                  np.array(fp4_mod.fp4_pack_ops(xb, kind)))


def test_fp4_pack_adversarial_set_reaches_the_scale_correction():
    """amax * fp32(1/6) lands on the other side of an E4M3 decision point than amax / 6 for some
    rows of the set, so the kernel's exact correction step is exercised, not just present."""
    amax = np.abs(adversarial_groups("kv")).max(axis=1)
    amax = mx.array(np.maximum(amax, F32(6 * 2.0 ** -9)))
    by_division = np.array(float_to_e4m3(amax / 6.0))
    by_reciprocal = np.array(float_to_e4m3(amax * mx.array(1 / 6, dtype=mx.float32)))
    assert (by_division != by_reciprocal).sum() >= 4


def test_fp4_pack_binds_inputs_as_device_buffers():
    run = pack_kernel()
    run(mx.ones((1, 16)), "kv")
    assert _buffer_spaces(run.kernel.last_source)["x"].startswith("const device float*")


# ------------------------------------------------------------------------------ SWA ring
def ring_groups(seed: int = 0) -> np.ndarray:
    """[N, 32] fp32 act_fp8 groups: E4M3 midpoints (normal and subnormal) at power-of-two
    scales, zeros, -0, groups under the 1e-4 floor, bf16-max, random."""
    r = rng(seed)
    mids = (E4M3_VALUES[:-1] + E4M3_VALUES[1:]) / 2
    groups = []
    for e in (-20, -3, 0, 7):
        pick = np.concatenate([[448.0], r.choice(mids, 31)]).astype(F32)
        pick *= np.where(r.random(32) < 0.5, -1, 1).astype(F32)
        groups.append(pick * F32(2.0 ** e))
        groups.append(np.concatenate([[F32(2 ** e)], mids[:31] * F32(2.0 ** (e - 8))]))
    groups += [np.zeros(32), np.full(32, -0.0), np.full(32, 3e-5), np.linspace(-5e-5, 1e-4, 32),
               np.full(32, 3.0e38), r.standard_normal(32) * 9]
    return np.stack(groups).astype(F32)


def _ring(batch, capacity, width, dtype, seed):
    """A ring of NaN in every slot but a few (uint8: packed rows of E4M3 NaN codes 0x7F and
    E8M0 NaN scales 0xFF), so a slot the kernel should have written, or copied, shows."""
    r = rng(seed)
    if dtype == mx.uint8:
        ring = np.full((batch, capacity, width + width // 32), 0x7F, dtype=np.uint8)
        ring[..., width:] = 0xFF
        ring[:, ::3] = r.integers(0, 256, (batch, len(range(0, capacity, 3)), ring.shape[-1]))
        return mx.array(ring)
    ring = np.full((batch, capacity, width), np.nan, dtype=F32)
    ring[:, ::3] = r.standard_normal((batch, len(range(0, capacity, 3)), width))
    return mx.array(ring).astype(dtype)


def _ring_values(ring: mx.array) -> mx.array:
    return unpack_fp8_e8m0(ring, mx.float32) if ring.dtype == mx.uint8 else ring


@pytest.mark.parametrize("batch, capacity, width, length, offset", [
    (2, 8, 64, 3, 0),      # partially filled first window
    (1, 8, 32, 5, 6),      # a chunk that spans the wrap
    (2, 16, 96, 1, 31),    # decode step at a wrap
    (1, 8, 64, 8, 13),     # S == R
    (1, 8, 32, 19, 2),     # S > R: only the last R rows land
])
def test_swa_ring_update_bit_exact(batch, capacity, width, length, offset):
    run = ring_kernel()
    pool = ring_groups(length).reshape(-1)
    keep = min(length, capacity)
    slots = mx.array([(offset + i) % capacity for i in range(length - keep, length)],
                     dtype=mx.int32)
    others = mx.array([s for s in range(capacity) if s not in np.array(slots)], dtype=mx.int32)
    for ring_dtype, rows_dtype in ((mx.bfloat16, mx.bfloat16), (mx.float32, mx.float32),
                                   (mx.uint8, mx.bfloat16), (mx.uint8, mx.float32)):
        ring = _ring(batch, capacity, width, ring_dtype, offset)
        rows = mx.array(np.resize(pool, (batch, length, width))).astype(rows_dtype)
        got, want = run(ring, rows, offset), ring_mod.swa_ring_update_ops(ring, rows, offset)
        assert got.dtype == ring.dtype and got.shape == ring.shape
        np.testing.assert_array_equal(bits(got) if ring_dtype != mx.uint8 else np.array(got),
                                      bits(want) if ring_dtype != mx.uint8 else np.array(want))
        # the kept rows hold their act_fp8 QDQ values; every other slot is untouched
        kept = act_fp8_qdq(rows[:, length - keep:].astype(mx.float32))
        np.testing.assert_array_equal(bits(_ring_values(got[:, slots]).astype(mx.float32)),
                                      bits(kept))
        if others.size:
            np.testing.assert_array_equal(np.array(got[:, others].view(mx.uint8)),
                                          np.array(ring[:, others].view(mx.uint8)))


def test_swa_ring_update_float16_ring():
    r = rng(13)
    ring = _ring(2, 8, 64, mx.float16, 2)
    rows = mx.array(r.standard_normal((2, 3, 64)).astype(F32) * 40).astype(mx.float16)
    got = ring_kernel()(ring, rows, 7)
    np.testing.assert_array_equal(bits(got), bits(ring_mod.swa_ring_update_ops(ring, rows, 7)))


@pytest.mark.parametrize("ring_dtype", [mx.bfloat16, mx.uint8])
def test_swa_ring_decode_loop_races_and_coverage(ring_dtype):
    """Prefill chunk then decode steps, all through the kernel with race/coverage checks, equal
    to a non-ring reference: slot p % R holds act_fp8_qdq(row p) for the last R positions."""
    batch, capacity, width = 1, 8, 64
    rows = mx.array(np.resize(ring_groups(3).reshape(-1), (batch, 13, width))).astype(mx.bfloat16)
    run = ring_kernel("checked")
    ring = _ring(batch, capacity, width, ring_dtype, 0)
    ring = run(ring, rows[:, :6], 0)
    for pos in range(6, 13):
        ring = run(ring, rows[:, pos:pos + 1], pos)
    rounded = act_fp8_qdq(rows.astype(mx.float32))
    for pos in range(13 - capacity, 13):
        row = _ring_values(ring[:, pos % capacity]).astype(mx.float32)
        np.testing.assert_array_equal(bits(row), bits(rounded[:, pos]))


def _mixed_rows(batch, length, width, dtype, seed):
    """[B, S, D] rows of the act_fp8 groups of `ring_groups`, a different draw per batch row."""
    groups = ring_groups(seed)
    pick = rng(seed).integers(0, len(groups), (batch, length, width // 32))
    return mx.array(groups[pick].reshape(batch, length, width)).astype(dtype)


def _ring_bytes(ring: mx.array) -> np.ndarray:
    return np.array(ring.view(mx.uint8))


# B rows, each at its own first position: 0, before the ring has wrapped, across its end, far
# beyond (several ring lengths); decode (S = 1), chunks, S == R and S > R.
MIXED_RING_CASES = [
    (8, 64, 1, (0,)),                     # B = 1, decode at position 0
    (8, 64, 1, (0, 5)),                   # decode: the first write, and before the wrap
    (8, 32, 3, (0, 6, 13)),               # a chunk at 0, one across the end, one wrapped
    (8, 64, 8, (0, 3, 8, 41)),            # S == R: every slot written, each row's own slots
    (16, 96, 1, (15, 2, 16 * 5 + 3, 31, 0)),  # B = 5 decode, a wrap, far beyond
    (8, 32, 5, (7, 100, 0, 250, 12)),     # B = 5 chunks, far beyond, across the end
    (8, 32, 11, (3, 30)),                 # S > R: only the last R rows of each row land
]


@pytest.mark.parametrize("capacity, width, length, positions", MIXED_RING_CASES)
def test_swa_ring_update_mixed_rows_bit_exact(capacity, width, length, positions):
    """Batch rows at their own positions in one launch (races and coverage checked): the bytes
    of the ops, and row b those of a batch-1 call at positions[b]."""
    batch = len(positions)
    run = ring_kernel("checked")
    for ring_dtype, rows_dtype in ((mx.bfloat16, mx.bfloat16), (mx.float32, mx.float32),
                                   (mx.uint8, mx.bfloat16), (mx.uint8, mx.float32)):
        ring = _ring(batch, capacity, width, ring_dtype, sum(positions))
        rows = _mixed_rows(batch, length, width, rows_dtype, length + batch)
        got = run(ring, rows, positions)
        assert got.dtype == ring.dtype and got.shape == ring.shape
        np.testing.assert_array_equal(_ring_bytes(got), _ring_bytes(
            ring_mod.swa_ring_update_ops(ring, rows, positions)))
        each = [ring_mod.swa_ring_update_ops(ring[b:b + 1], rows[b:b + 1], p)
                for b, p in enumerate(positions)]
        np.testing.assert_array_equal(_ring_bytes(got), _ring_bytes(mx.concatenate(each)))
    # the dispatcher, the positions as a list or an int32/int64 array: the same bytes
    for given in (list(positions), mx.array(positions, mx.int32), mx.array(positions, mx.int64)):
        np.testing.assert_array_equal(
            _ring_bytes(ring_mod.swa_ring_update(ring, rows, given, run=run)), _ring_bytes(got))
    if batch > 1:  # a kernel of row 0's position for every row would not be these bytes
        shared = ring_mod.swa_ring_update_ops(ring, rows, positions[0])
        assert not np.array_equal(_ring_bytes(got), _ring_bytes(shared))


def test_swa_ring_update_mixed_decode_loop():
    """Three sequences at positions 0, 5 and 21 decoding 10 steps, each step one launch for all
    rows: the ring of each row equals that of its own batch-1 kernel calls."""
    batch, capacity, width, steps = 3, 8, 64, 10
    starts = (0, 5, 21)
    rows = _mixed_rows(batch, steps, width, mx.bfloat16, 4)
    run = ring_kernel()
    ring = _ring(batch, capacity, width, mx.uint8, 4)
    alone = [ring[b:b + 1] for b in range(batch)]
    for step in range(steps):
        ring = run(ring, rows[:, step:step + 1], tuple(p + step for p in starts))
        alone = [run(alone[b], rows[b:b + 1, step:step + 1], starts[b] + step)
                 for b in range(batch)]
        np.testing.assert_array_equal(_ring_bytes(ring), _ring_bytes(mx.concatenate(alone)))


def test_swa_ring_update_per_row_dispatcher():
    """Per-row positions without the kernel: the ops (any form of the positions); with
    one: a single launch; bad per-row input: a one-line ValueError naming the problem."""
    ring = _ring(3, 8, 64, mx.uint8, 5)
    rows = _mixed_rows(3, 2, 64, mx.bfloat16, 5)
    positions = (4, 0, 29)
    want = _ring_bytes(ring_mod.swa_ring_update_ops(ring, rows, positions))
    for given in (positions, list(positions), mx.array(positions, mx.int32),
                  mx.array(positions, mx.int64)):
        got = ring_mod.swa_ring_update(ring, rows, given, use_kernel=False)
        np.testing.assert_array_equal(_ring_bytes(got), want)
    np.testing.assert_array_equal(  # an int: the same ops as before
        _ring_bytes(ring_mod.swa_ring_update(ring, rows, 7, use_kernel=False)),
        _ring_bytes(ring_mod.swa_ring_update_ops(ring, rows, 7)))
    calls = []

    def counted(*args):
        calls.append(args[2])
        return ring_kernel()(*args)

    got = ring_mod.swa_ring_update(ring, rows, mx.array(positions), run=counted)
    np.testing.assert_array_equal(_ring_bytes(got), want)
    assert calls == [positions]
    column = mx.array(positions).reshape(-1, 1)  # the [B, 1] form rope_products takes
    np.testing.assert_array_equal(
        _ring_bytes(ring_mod.swa_ring_update(ring, rows, column, use_kernel=False)), want)
    for bad, problem in [((4, 0), "2 positions for 3 batch rows"),
                         ((4, -1, 2), "position -1 of row 1"),
                         (mx.array([1.0, 2.0, 3.0]), "int32 or int64 array"),
                         (mx.array([[1, 2, 3]]), "int32 or int64 array")]:
        with pytest.raises(ValueError, match=problem) as error:
            ring_mod.swa_ring_update(ring, rows, bad, use_kernel=False)
        assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="a ring of 2 batch rows for rows of 3"):
        ring_mod.swa_ring_update(ring[:2], rows, positions, use_kernel=False)


def test_swa_ring_update_self_check_passes_in_the_simulator():
    """The self-check (an int and a two-row per-row call) keeps the simulated kernel."""
    from tests.kernel_faults import warnings_of
    run, messages = warnings_of(ring_mod.SWA_RING_UPDATE.build_checked, checked)
    assert run is not ring_mod.swa_ring_update_ops and not messages, messages


# ------------------------------------------------------------------------------ sparse attention
def bf16_round(x: np.ndarray) -> np.ndarray:
    return np.array(mx.array(np.asarray(x, F32)).astype(mx.bfloat16).astype(mx.float32), np.float64)


def blocked_model(q, window, packed_kv, rows, sinks, scale, window_size):
    """float64 model of the kernel's documented algorithm: entries = window slots then `rows`,
    online softmax over blocks of 64 entries, p rounded to bf16 relative to the running max
    after each block. Returns (output, magnitude = sum_k bf16(p_k) |v_k| / denominator)."""
    q = np.array(q.astype(mx.float32), np.float64)
    window = np.array(window.astype(mx.float32), np.float64)
    total = packed_kv.shape[1]
    keys = np.array(unpack_fp4_e4m3(packed_kv, mx.float32), np.float64) if total else None
    rows, sinks = np.array(rows), np.array(sinks, np.float64)
    batch, length, heads, dim = q.shape
    prefix = window.shape[1] - length
    out, mag = np.zeros(q.shape), np.zeros(q.shape)
    for b in range(batch):
        for s in range(length):
            j = prefix + s - window_size + 1 + np.arange(window_size)
            entries = [window[b, np.maximum(j, 0)] * (j >= 0)[:, None]]
            valid = [j >= 0]
            if rows.shape[-1]:
                r = rows[b, s]
                ok = (r >= 0) & (r < total)
                picked = keys[b, np.where(ok, r, 0)] if total else np.zeros((len(r), dim))
                entries.append(picked * ok[:, None])
                valid.append(ok)
            kv, valid = np.concatenate(entries), np.concatenate(valid)
            z = np.where(valid, q[b, s] @ kv.T * scale, -np.inf)                     # [H, N]
            m, row_sum = np.full(heads, -1e30), np.zeros(heads)
            acc, am = np.zeros((heads, dim)), np.zeros((heads, dim))
            for start in range(0, z.shape[1], 64):
                zb, vb = z[:, start:start + 64], kv[start:start + 64]
                m_new = np.maximum(m, zb.max(axis=1))
                alpha, p = np.exp(m - m_new), np.exp(zb - m_new[:, None])
                pb = bf16_round(p)
                row_sum = row_sum * alpha + p.sum(axis=1)
                acc = acc * alpha[:, None] + pb @ vb
                am = am * alpha[:, None] + pb @ np.abs(vb)
                m = m_new
            denom = (row_sum + np.exp(sinks - m))[:, None]
            out[b, s], mag[b, s] = acc / denom, am / denom
    return out, mag


def attention_inputs(batch, length, heads, dim, prefix, total, topk, seed):
    r = rng(seed)
    q = mx.array(r.standard_normal((batch, length, heads, dim)).astype(F32) * 2).astype(mx.bfloat16)
    window = mx.array(r.standard_normal((batch, prefix + length, dim)).astype(F32))
    window = act_fp8_qdq(window.astype(mx.bfloat16))  # window rows are FP8-rounded in the model
    packed = pack_fp4_e4m3(mx.array(r.standard_normal((batch, total, dim)).astype(F32) * 2))
    rows = r.integers(0, max(total, 1), size=(batch, length, topk)).astype(np.int32)
    if topk:
        rows[..., r.random((batch, length, topk)) < 0.2] = -1  # holes in the middle
        rows[..., -3:] = -1                                      # and at the end
        rows[..., 0] = total - 1 if total else -1                # the cache's last row
        rows[0, 0, min(1, topk - 1)] = total + 5                 # out of range counts as empty
    sinks = mx.array(r.standard_normal(heads).astype(F32))
    return q, window, packed, mx.array(rows), sinks


ATTENTION_CASES = {
    # name: (batch, length, heads, dim, prefix, window_size, total, topk, heads_per_group,
    #        simdgroups)
    "decode_full_window": (1, 1, 8, 64, 127, 128, 150, 70, None, 4),
    "decode_d512": (1, 1, 4, 512, 127, 128, 200, 130, None, 4),
    "prefill_from_zero": (2, 5, 4, 64, 0, 8, 40, 37, 2, 2),
    "chunk_after_prefix": (1, 7, 4, 64, 3, 8, 20, 37, 4, 1),
    "no_compressed_rows": (1, 3, 2, 32, 5, 16, 0, 0, 1, 4),
    "empty_cache_with_holes": (1, 2, 4, 96, 2, 4, 0, 9, None, 4),
    "long_window_blocks": (1, 3, 8, 32, 70, 100, 300, 150, 8, 4),
}


def assert_attention_close(got, q, window, packed, rows, sinks, scale, window_size):
    """Bounds, per output element, with mag = sum_k bf16(p_k) |v_k| / denominator:
    * vs the float64 model of the kernel's algorithm (`blocked_model`): <= 1 bf16 ulp of the
      model's value (+ 2^-20 mag near zero): only the final bf16 rounding and fp32 sums differ;
    * vs `sparse_attention_ops`: <= 2^-7 mag. The ops round p to bf16 relative to the global
      max instead of the running max per block (<= 2^-9 relative each side), and both outputs
      are rounded to bf16 (<= 2^-9 mag each)."""
    ops = attn_mod.sparse_attention_ops(q, window, packed, rows, sinks, scale, window_size)
    model, mag = blocked_model(q, window, packed, rows, sinks, scale, window_size)
    got = np.array(got.astype(mx.float32), np.float64)
    ops = np.array(ops.astype(mx.float32), np.float64)
    assert np.isfinite(got).all()
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(model), 1e-30))) - 7)
    assert (np.abs(got - model) <= ulp + 2.0 ** -20 * mag).all()
    assert (np.abs(got - ops) <= 2.0 ** -7 * mag + 1e-30).all()


@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
def test_sparse_attention_matches_ops_and_blocked_model(case):
    batch, length, heads, dim, prefix, window_size, total, topk, group, nsg = ATTENTION_CASES[case]
    args = attention_inputs(batch, length, heads, dim, prefix, total, topk, seed=len(case))
    got = attention_kernel()(*args, dim ** -0.5, window_size, heads=group, simdgroups=nsg)
    assert_attention_close(got, *args, dim ** -0.5, window_size)


def test_sparse_attention_peaky_scores_and_large_sinks():
    """Sharp softmax whose max arrives in a later block (rescaling of l and acc), heads whose
    sink dominates the denominator, and one whose sink is negligible."""
    q, window, packed, rows, sinks = attention_inputs(1, 2, 4, 64, 100, 300, 150, seed=12)
    q = (q.astype(mx.float32) * 6).astype(mx.bfloat16)
    sinks = mx.array([40.0, -40.0, 0.0, 12.0], dtype=mx.float32)
    got = attention_kernel()(q, window, packed, rows, sinks, 0.125, 128)
    assert_attention_close(got, q, window, packed, rows, sinks, 0.125, 128)


def test_sparse_attention_races():
    """One shape under check_races (reverse and shuffled lane orders) and check_coverage."""
    q, window, packed, rows, sinks = attention_inputs(1, 2, 4, 64, 70, 30, 45, seed=3)
    got = attention_kernel("checked")(q, window, packed, rows, sinks, 0.125, 100, heads=2)
    assert_attention_close(got, q, window, packed, rows, sinks, 0.125, 100)


# Batch rows of one stacked call: (query rows, window rows held before the call) each, some
# windows still filling (held < window - 1: 0 rows, a few, one short), some full.
STACKED_ATTENTION_CASES = {
    "decode": (1, (0, 3, 15, 15, 6, 14), 16, 40, 21),
    "verify_block": (3, (2, 15, 0, 9), 16, 30, 12),
    "long_window": (1, (1, 99, 70), 100, 300, 80),
}


@pytest.mark.parametrize("case", sorted(STACKED_ATTENTION_CASES))
def test_sparse_attention_stacked_rows_with_windows_still_filling(case):
    """Sequences stacked into one call, each window padded at the front to window - 1 held
    rows (zero rows) and `window_first` its first filled row: each batch row gets the bits of
    its own batch-1 call, on the kernel (races and coverage checked) and on the ops; without
    `window_first` the padded rows count and the filling rows differ."""
    length, held, window_size, total, topk = STACKED_ATTENTION_CASES[case]
    heads, dim, prefix = 4, 64, window_size - 1
    parts = [attention_inputs(1, length, heads, dim, h, total, topk, seed=40 + b)
             for b, h in enumerate(held)]
    sinks = parts[0][4]
    padded = [mx.concatenate([mx.zeros((1, prefix - h, dim), mx.bfloat16), part[1]], axis=1)
              for h, part in zip(held, parts)]
    q, window, packed, rows = (mx.concatenate(x) for x in (
        [p[0] for p in parts], padded, [p[2] for p in parts], [p[3] for p in parts]))
    first = [prefix - h for h in held]
    run = attention_kernel("checked")
    got = attn_mod.sparse_attention(q, window, packed, rows, sinks, 0.125, window_size,
                                    first, run=run)
    ops = attn_mod.sparse_attention_ops(q, window, packed, rows, sinks, 0.125, window_size,
                                        mx.array(first))
    for b, (pq, pw, pp, pr, _) in enumerate(parts):
        alone = run(pq, pw, pp, pr, sinks, 0.125, window_size)
        np.testing.assert_array_equal(bits(got[b:b + 1]), bits(alone))
        np.testing.assert_array_equal(bits(ops[b:b + 1]), bits(attn_mod.sparse_attention_ops(
            pq, pw, pp, pr, sinks, 0.125, window_size)))
    unmasked = attn_mod.sparse_attention(q, window, packed, rows, sinks, 0.125, window_size,
                                         run=run)
    filling = [b for b, h in enumerate(held) if h < prefix]
    assert all(not np.array_equal(bits(unmasked[b]), bits(got[b])) for b in filling)


def test_sparse_attention_rejects_a_bad_window_first():
    q, window, packed, rows, sinks = attention_inputs(2, 1, 2, 64, 5, 4, 2, seed=13)
    for bad, problem in [((0,), "must be 2 ints"), ((0, 6), "out of \\[0, 5\\]"),
                         ((0.5, 1.0), "must be 2 ints")]:
        with pytest.raises(ValueError, match=problem) as error:
            attn_mod.sparse_attention(q, window, packed, rows, sinks, 0.125, 8, bad)
        assert "\n" not in str(error.value)


def _buffer_spaces(source: str) -> dict:
    """Generated signature: buffer name -> its declaration line."""
    lines = [line.strip() for line in source.splitlines() if "[[buffer(" in line]
    return {line.split("[[")[0].split()[-1].lstrip("*&"): line for line in lines}


def test_sparse_attention_small_inputs_bind_as_device_buffers():
    """K = 0, T = 0 and H < 8 are padded, so the kernel text is the production variant."""
    q, window, packed, rows, sinks = attention_inputs(1, 1, 2, 32, 0, 0, 0, seed=4)
    run = attention_kernel()
    out = run(q, window, packed, rows, sinks, 0.2, 8)
    want = attn_mod.sparse_attention_ops(q, window, packed, rows, sinks, 0.2, 8)
    np.testing.assert_array_equal(bits(out), bits(want))
    spaces = _buffer_spaces(run.kernel.last_source)
    for name in ("q", "window", "packed", "rows", "sinks", "window_first"):
        assert spaces[name].startswith("const device"), spaces[name]


def test_pack_then_attend_end_to_end():
    """Rows packed by the pack kernel, appended to a cache, attended by the attention kernel."""
    r = rng(6)
    batch, heads, dim, window_size = 1, 4, 64, 16
    latents = mx.array(r.standard_normal((batch, 40, dim)).astype(F32) * 3).astype(mx.bfloat16)
    chunks = (latents[:, :25], latents[:, 25:])
    cache = mx.concatenate([pack_kernel()(chunk, "kv") for chunk in chunks], axis=1)
    np.testing.assert_array_equal(np.array(cache), np.array(fp4_mod.fp4_pack_ops(latents, "kv")))
    q, window, _, rows, sinks = attention_inputs(batch, 2, heads, dim, 6, 40, 21, seed=7)
    got = attention_kernel()(q, window, cache, rows, sinks, 0.125, window_size)
    assert_attention_close(got, q, window, cache, rows, sinks, 0.125, window_size)


# ------------------------------------------------------------------------------ dispatchers
@pytest.mark.skipif(mx.metal.is_available(), reason="checks the fallback on machines without Metal")
def test_dispatchers_fall_back_to_ops_without_metal():
    """Here the Metal kernels cannot run (calling one raises), so equal results prove the
    fallback."""
    x = mx.array(rng(8).standard_normal((3, 64)).astype(F32)).astype(mx.bfloat16)
    for kind in ("kv", "index"):
        np.testing.assert_array_equal(np.array(fp4_mod.fp4_pack(x, kind)),
                                      np.array(fp4_mod.fp4_pack_ops(x, kind)))
    ring = _ring(1, 8, 64, mx.bfloat16, 1)
    rows = x[None, :, :]
    np.testing.assert_array_equal(bits(ring_mod.swa_ring_update(ring, rows, 5)),
                                  bits(ring_mod.swa_ring_update_ops(ring, rows, 5)))
    args = attention_inputs(1, 2, 4, 64, 3, 20, 9, seed=9)
    np.testing.assert_array_equal(bits(attn_mod.sparse_attention(*args, 0.125, 8)),
                                  bits(attn_mod.sparse_attention_ops(*args, 0.125, 8)))
    with pytest.raises(RuntimeError):
        fp4_mod.FP4_PACK.build()(x, "kv")  # the production kernel itself needs Metal


def test_sparse_attention_rejects_a_wrong_packed_width():
    q, window, packed, rows, sinks = attention_inputs(1, 1, 2, 64, 0, 4, 2, seed=10)
    with pytest.raises(ValueError, match="36 bytes"):
        attn_mod.sparse_attention(q, window, packed[..., :-1], rows, sinks, 0.125, 8)


# ------------------------------------------------------------------------------ real Metal
@pytest.mark.metal
@has_metal
def test_metal_kernels_match_ops_on_device():
    with mx.stream(mx.gpu):  # the module runs on the CPU; Metal kernels run on the GPU only
        x = mx.array(adversarial_groups("kv").reshape(-1, 64))
        assert mx.array_equal(fp4_mod.fp4_pack(x, "kv"), fp4_mod.fp4_pack_ops(x, "kv"))
        xi = mx.array(adversarial_groups("index").reshape(-1, 64))
        assert mx.array_equal(fp4_mod.fp4_pack(xi, "index"), fp4_mod.fp4_pack_ops(xi, "index"))
        ring = _ring(1, 16, 64, mx.bfloat16, 0)
        rows = mx.array(np.resize(ring_groups().reshape(-1), (1, 5, 64))).astype(mx.bfloat16)
        np.testing.assert_array_equal(bits(ring_mod.swa_ring_update(ring, rows, 14)),
                                      bits(ring_mod.swa_ring_update_ops(ring, rows, 14)))
        for case in ATTENTION_CASES.values():
            batch, length, heads, dim, prefix, window_size, total, topk = case[:8]
            args = attention_inputs(batch, length, heads, dim, prefix, total, topk, seed=11)
            got = attn_mod.sparse_attention(*args, dim ** -0.5, window_size)
            assert_attention_close(got, *args, dim ** -0.5, window_size)


def test_sparse_attention_ops_row_blocks_are_exact(monkeypatch):
    """The ops path gathers keys for blocks of query rows; blocks of one row give the same bits."""
    rng = np.random.default_rng(7)
    batch, length, heads, dim, window_size, total, topk = 2, 13, 3, 32, 5, 11, 4
    q = mx.array(rng.standard_normal((batch, length, heads, dim)), dtype=mx.bfloat16)
    window = mx.array(rng.standard_normal((batch, 3 + length, dim)), dtype=mx.bfloat16)
    packed = mx.array(rng.integers(0, 256, (batch, total, dim // 2 + dim // 16)), dtype=mx.uint8)
    packed = mx.concatenate([packed[..., :dim // 2], mx.full(packed[..., dim // 2:].shape, 0x38,
                                                            mx.uint8)], axis=-1)
    rows = mx.array(rng.integers(-1, total + 2, (batch, length, topk)), dtype=mx.int32)
    sinks = mx.array(rng.standard_normal(heads), dtype=mx.float32)
    whole = attn_mod.sparse_attention_ops(q, window, packed, rows, sinks, 0.17, window_size)
    monkeypatch.setattr(attn_mod, "GATHER_BLOCK_ELEMENTS", 1)
    blocked = attn_mod.sparse_attention_ops(q, window, packed, rows, sinks, 0.17, window_size)
    assert blocked.shape == whole.shape and mx.array_equal(blocked, whole)
    assert not mx.isnan(whole.astype(mx.float32)).any()


def test_small_kernel_inputs_are_padded_once_per_array():
    """Kernel inputs of fewer than 8 floats (a layer's 3 mix scales, a small model's attention
    sinks) are zero-padded to 8 once per array, not a Full and a Concatenate per call, and a
    new array (a reloaded parameter) gets its own; 8 or more pass through as fp32."""
    from mlx_v41.kernels.builder import device_buffer

    sinks = mx.array([0.5, -1.0, 2.0, 0.25], dtype=mx.float32)
    padded = device_buffer(sinks)
    assert device_buffer(sinks) is padded
    assert padded.tolist() == [0.5, -1.0, 2.0, 0.25, 0.0, 0.0, 0.0, 0.0]
    other = sinks * 2
    assert device_buffer(other) is not padded and device_buffer(other).tolist()[:4] == \
        [1.0, -2.0, 4.0, 0.5]
    wide = mx.arange(9, dtype=mx.bfloat16)
    assert device_buffer(wide).dtype == mx.float32 and device_buffer(wide).size == 9
