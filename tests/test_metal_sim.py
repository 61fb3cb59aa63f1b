"""The Metal simulator (tests/metal_sim): generator agreement with MLX, execution model, detectors.

Every kernel here is a small example written for these tests and compared against numpy.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np
import pytest

from mlx_v41.kernels.builder import build_kernel, metal_text
from tests.metal_sim import KernelRuntimeError, MetalCompileError, SimOptions, metal_kernel
from tests.metal_sim import generator

sim = functools.partial(metal_kernel, options=SimOptions())
racy = functools.partial(metal_kernel, options=SimOptions(check_races=True, check_coverage=True))
lenient = functools.partial(metal_kernel, options=SimOptions(strict=False))
RNG = np.random.default_rng(0)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, as MLX's astype does (round to nearest even)."""
    return np.asarray(mx.array(x.astype(np.float32)).astype(mx.bfloat16).view(mx.uint16))


# ------------------------------------------------------------------------------ generated text
_ATTR_SOURCE = """
uint i = thread_position_in_grid.x + grid_size.x * 0 + dispatch_threads_per_threadgroup.x * 0;
// uses: simdgroup_index_in_threadgroup thread_index_in_simdgroup threadgroups_per_grid
// dispatch_simdgroups_per_threadgroup quadgroup_index_in_threadgroup thread_execution_width
out[i] = x[i] + x_shape[0] + y_strides[0] + y_ndim + s + c[0];
"""

GENERATOR_CASES = {
    "template_mix_and_sizes": dict(
        spec=dict(name="gen_a", input_names=["x", "y", "s", "c"], output_names=["out"],
                  source=_ATTR_SOURCE,
                  header="#define GEN_A 1\ninline float twice(float v) { return 2 * v; }\n"),
        inputs=[mx.zeros((4, 16)), mx.zeros((9,), mx.int32), mx.array(1.5),
                mx.zeros((3,), mx.float16)],
        out_dtypes=[mx.float32],
        template=[("T", mx.bfloat16), ("N", 7), ("B", True), ("C", False)]),
    "atomic_two_outputs": dict(
        spec=dict(name="gen_b", input_names=["idx"], output_names=["h", "g"], atomic_outputs=True,
                  source="uint i = thread_position_in_grid.x; "
                         "atomic_fetch_add_explicit(&h[idx[i]], 1, memory_order_relaxed); "
                         "atomic_fetch_add_explicit(&g[0], 1, memory_order_relaxed);"),
        inputs=[mx.zeros((100,), mx.int32)], out_dtypes=[mx.uint32, mx.int32], template=[]),
    "separator_quirk_no_attribute": dict(
        spec=dict(name="gen_c", input_names=["x"], output_names=["o1", "o2"],
                  source="o1[0] = x[0] + x_shape[0]; o2[0] = x[0];"),
        inputs=[mx.zeros((10,), mx.uint8)], out_dtypes=[mx.uint8, mx.bool_], template=[("K", 0)]),
    "no_inputs_scalar_only": dict(
        spec=dict(name="gen_d", input_names=["a"], output_names=["o"], header="",
                  source="o[thread_index_in_threadgroup] = a;"),
        inputs=[True], out_dtypes=[mx.bool_], template=[("T", mx.int64), ("BIG", -3)]),
}


@pytest.mark.parametrize("case", sorted(GENERATOR_CASES))
def test_port_matches_mlx_generated_source(case):
    """The port is byte-identical to the text MLX itself generates (captured under export
    tracing)."""
    c = GENERATOR_CASES[case]
    s = c["spec"]
    spec = generator.KernelSpec(s["name"], tuple(s["input_names"]), tuple(s["output_names"]),
                                s["source"], s.get("header", ""), True,
                                s.get("atomic_outputs", False))
    arrays = [x if isinstance(x, mx.array) else mx.array(x) for x in c["inputs"]]
    metas = [generator.InputMeta(a.dtype, a.ndim, a.size) for a in arrays]
    port = generator.port_source(spec, metas, c["out_dtypes"], c["template"])
    captured = generator.capture_source(spec, metas, c["out_dtypes"], c["template"])
    assert port == captured


def test_simulator_runs_the_text_mlx_generates(capsys):
    """What the simulator compiles (and prints with verbose=True) is MLX's own text."""
    src = "uint i = thread_position_in_grid.x; if (i < n) out[i] = T(inp[i] * s);"
    inp = mx.arange(19, dtype=mx.float32)
    kw = dict(inputs=[inp, 19, 0.5], template=[("T", mx.float16)], grid=(32, 1, 1),
              threadgroup=(32, 1, 1), output_shapes=[(19,)], output_dtypes=[mx.float16])
    k = metal_kernel("scale", ["inp", "n", "s"], ["out"], src, options=SimOptions(source="port"))
    out, = k(verbose=True, **kw)
    printed = capsys.readouterr().out
    spec = k.spec
    metas = [generator.InputMeta(mx.float32, 1, 19), generator.InputMeta(mx.int32, 0, 1),
             generator.InputMeta(mx.float32, 0, 1)]
    mlx_text = generator.capture_source(spec, metas, [mx.float16], [("T", mx.float16)])
    assert k.last_source == mlx_text
    assert printed == f"Generated source code for `scale`:\n```\n{mlx_text}\n```\n"
    np.testing.assert_array_equal(np.array(out), (np.arange(19) * 0.5).astype(np.float16))


def test_argument_checks_match_mlx():
    with pytest.raises(ValueError, match="at least one output"):
        metal_kernel("k", ["x"], [], "")
    with pytest.raises(ValueError, match="Unknown compile option"):
        metal_kernel("k", ["x"], ["o"], "", compile_options={"opt": 1})
    k = sim("k", ["x"], ["o"], "o[0] = x[0];")
    base = dict(inputs=[mx.zeros(8)], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)],
                output_dtypes=[mx.float32])
    with pytest.raises(ValueError, match="Expected `inputs` to have size 1 but got size 0"):
        k(**{**base, "inputs": []})
    with pytest.raises(ValueError, match="Invalid template argument"):
        k(**base, template=[("T", 1.5)])
    with pytest.raises(ValueError, match="maximum of 1024"):
        k(**{**base, "threadgroup": (2048, 1, 1)})
    with pytest.raises(TypeError, match="not supported on Apple GPUs"):
        k(**{**base, "output_dtypes": [mx.float64]})


# ------------------------------------------------------------------------------ execution
def test_elementwise_with_template_parameters():
    src = """
    uint i = thread_position_in_grid.x;
    if (i < inp_shape[0] * inp_shape[1]) {
      float v = float(inp[i]) * scale + float(N);
      out[i] = B ? T(metal::exp(-v * v)) : T(v);
    }
    """
    k = sim("elementwise", ["inp", "scale"], ["out"], src)
    x = RNG.standard_normal((7, 13)).astype(np.float32)
    for dt_in, dt_out, n, b in [(mx.float32, mx.float32, 2, True),
                                (mx.float16, mx.bfloat16, -1, False),
                                (mx.bfloat16, mx.float16, 0, True)]:
        xin = mx.array(x).astype(dt_in)
        out, = k(inputs=[xin, 0.75], template=[("T", dt_out), ("N", n), ("B", b)], grid=(96, 1, 1),
                 threadgroup=(32, 1, 1), output_shapes=[(7, 13)], output_dtypes=[dt_out])
        v = np.array(xin.astype(mx.float32)) * 0.75 + n
        ref = np.exp(-v * v) if b else v
        np.testing.assert_allclose(np.array(out.astype(mx.float32)), ref, rtol=1e-2, atol=1e-3)


_REDUCE = """
threadgroup float buf[TG];
uint tid = thread_position_in_threadgroup.x;
uint row = threadgroup_position_in_grid.y;
uint n = inp_shape[1];
float m = Limits<float>::min;
for (uint j = tid; j < n; j += TG) m = max(m, float(inp[row * n + j]));
buf[tid] = m;
threadgroup_barrier(mem_flags::mem_threadgroup);
for (uint s = TG / 2; s > 0; s >>= 1) {
  if (tid < s) buf[tid] = max(buf[tid], buf[tid + s]);
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
float rmax = buf[0];
threadgroup_barrier(mem_flags::mem_threadgroup);
float acc = 0.0f;
for (uint j = tid; j < n; j += TG) acc += metal::exp(float(inp[row * n + j]) - rmax);
buf[tid] = acc;
threadgroup_barrier(mem_flags::mem_threadgroup);
for (uint s = TG / 2; s > 0; s >>= 1) {
  if (tid < s) buf[tid] += buf[tid + s];
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
if (tid == 0) {
  row_max[row] = rmax;
  row_sumexp[row] = buf[0];
}
"""


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_threadgroup_reduction_with_barriers(dtype):
    k = racy("tg_reduce", ["inp"], ["row_max", "row_sumexp"], _REDUCE)
    x = mx.array(RNG.standard_normal((7, 1001)).astype(np.float32) * 3).astype(dtype)
    tg = 128
    mx_out, se = k(inputs=[x], template=[("TG", tg)], grid=(tg, 7, 1), threadgroup=(tg, 1, 1),
                   output_shapes=[(7,), (7,)], output_dtypes=[mx.float32, mx.float32])
    xf = np.array(x.astype(mx.float32)).astype(np.float64)
    np.testing.assert_array_equal(np.array(mx_out), xf.max(1).astype(np.float32))
    np.testing.assert_allclose(np.array(se), np.exp(xf - xf.max(1, keepdims=True)).sum(1),
                               rtol=1e-5)
    assert k.last_stats["barriers"] == 7 * (3 + 2 * 7)


_SIMD = """
uint i = thread_position_in_grid.x;
uint lane = thread_index_in_simdgroup;
float v = x[i];
device float* o = out + i * 14;
o[0] = simd_sum(v);
o[1] = simd_max(v);
o[2] = simd_min(v);
o[3] = simd_prefix_exclusive_sum(v);
o[4] = simd_prefix_inclusive_sum(v);
o[5] = simd_shuffle(v, (lane * 7 + 3) % 32);
o[6] = simd_shuffle_down(v, 5);
o[7] = simd_shuffle_up(v, 3);
o[8] = simd_shuffle_xor(v, 6);
o[9] = simd_broadcast(v, 17);
o[10] = quad_sum(v);
o[11] = simd_shuffle_rotate_down(v, 9);
float2 p = simd_sum(float2(v, 2.0f * v));
o[12] = p.y;
o[13] = simd_shuffle_and_fill_down(v, -v, 4, 8);
device uint* u = bits + i * 5;
u[0] = uint(uint64_t(simd_ballot(v > 0.0f)));
u[1] = simd_or(1u << (lane % 8));
u[2] = simd_all(v > -100.0f) ? 1 : 0;
u[3] = simd_any(v > 2.5f) ? 1 : 0;
u[4] = simd_is_first() ? 1 : 0;
"""


def _simd_reference(x: np.ndarray):
    ref = np.zeros((len(x), 14), np.float64)
    bits = np.zeros((len(x), 5), np.uint64)
    for s in range(0, len(x), 32):
        v = x[s:s + 32].astype(np.float64)
        lane = np.arange(32)
        ref[s:s + 32, 0] = v.sum()
        ref[s:s + 32, 1] = v.max()
        ref[s:s + 32, 2] = v.min()
        ref[s:s + 32, 3] = np.concatenate([[0], np.cumsum(v)[:-1]])
        ref[s:s + 32, 4] = np.cumsum(v)
        ref[s:s + 32, 5] = v[(lane * 7 + 3) % 32]
        ref[s:s + 32, 6] = np.where(lane + 5 < 32, v[np.minimum(lane + 5, 31)], v)
        ref[s:s + 32, 7] = np.where(lane >= 3, v[np.maximum(lane - 3, 0)], v)
        ref[s:s + 32, 8] = v[lane ^ 6]
        ref[s:s + 32, 9] = v[17]
        ref[s:s + 32, 10] = v.reshape(8, 4).sum(1).repeat(4)
        ref[s:s + 32, 11] = v[(lane + 9) % 32]
        ref[s:s + 32, 12] = 2 * v.sum()
        j = lane % 8 + 4
        base = lane - lane % 8
        ref[s:s + 32, 13] = np.where(j < 8, v[base + np.minimum(j, 7)],
                                     -v[base + np.maximum(j - 8, 0)])
        bits[s:s + 32, 0] = sum(1 << int(k) for k in lane[v > 0])
        bits[s:s + 32, 1] = 0xFF
        bits[s:s + 32, 2] = 1
        bits[s:s + 32, 3] = int((v > 2.5).any())
        bits[s:s + 32, 4] = lane == 0
    return ref, bits


def test_simd_operations_against_numpy():
    k = racy("simd_ops", ["x"], ["out", "bits"], _SIMD)
    n = 192  # 3 threadgroups of 2 simdgroups
    x = RNG.standard_normal(n).astype(np.float32) * 2
    out, bits = k(inputs=[mx.array(x)], grid=(n, 1, 1), threadgroup=(64, 1, 1),
                  output_shapes=[(n, 14), (n, 5)], output_dtypes=[mx.float32, mx.uint32])
    ref, ref_bits = _simd_reference(x)
    np.testing.assert_allclose(np.array(out), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.array(bits), ref_bits.astype(np.uint32))


_PARTIAL = """
uint lane = thread_index_in_simdgroup;
float v = x[thread_position_in_grid.x];
float r = -1.0f;
if (lane < 20) r = simd_sum(v);
out[thread_position_in_grid.x] = r;
"""


def test_simd_ops_cover_active_lanes_only():
    """A divergent simd_sum reduces over the active lanes; strict mode (the default) rejects it."""
    x = RNG.standard_normal(64).astype(np.float32)
    args = dict(inputs=[mx.array(x)], grid=(64, 1, 1), threadgroup=(64, 1, 1),
                output_shapes=[(64,)], output_dtypes=[mx.float32])
    k = lenient("partial_simd", ["x"], ["out"], _PARTIAL)
    out, = k(**args)
    ref = np.full(64, -1.0)
    for s in (0, 32):
        ref[s:s + 20] = x[s:s + 20].sum()
    np.testing.assert_allclose(np.array(out), ref, rtol=1e-5)
    assert k.last_stats["partial_simd_ops"] == 2
    with pytest.raises(KernelRuntimeError, match=r"\[source:5\]: threadgroup \(0,0,0\): "
                                                 r"SIMD operation executed by part of simdgroup 0"):
        sim("partial_simd", ["x"], ["out"], _PARTIAL)(**args)


def test_edge_threadgroups_and_partial_last_simdgroup():
    """A 48-thread group has a 16-lane second simdgroup; its simd_sum covers those 16 lanes."""
    src = "float s = simd_sum(x[thread_position_in_grid.x]); out[thread_position_in_grid.x] = s;"
    x = RNG.standard_normal(100).astype(np.float32)
    out, = sim("tail_simd", ["x"], ["out"], src)(
        inputs=[mx.array(x)], grid=(100, 1, 1), threadgroup=(48, 1, 1), output_shapes=[(100,)],
        output_dtypes=[mx.float32])
    ref = np.empty(100)
    for g0 in range(0, 100, 48):
        for s in range(g0, min(g0 + 48, 100), 32):
            e = min(s + 32, g0 + 48, 100)
            ref[s:e] = x[s:e].sum()
    np.testing.assert_allclose(np.array(out), ref, rtol=1e-5)


_ATTR_KERNEL = """
uint3 G = threads_per_grid;
uint gid = thread_position_in_grid.x + thread_position_in_grid.y * G.x
           + thread_position_in_grid.z * G.x * G.y;
device uint* o = out + gid * 38;
uint3 v3[9] = {dispatch_threads_per_threadgroup, grid_origin, grid_size, thread_position_in_grid,
               thread_position_in_threadgroup, threadgroup_position_in_grid, threadgroups_per_grid,
               threads_per_grid, threads_per_threadgroup};
for (int k = 0; k < 9; ++k) { o[3 * k] = v3[k].x; o[3 * k + 1] = v3[k].y; o[3 * k + 2] = v3[k].z; }
uint s[11] = {dispatch_quadgroups_per_threadgroup, dispatch_simdgroups_per_threadgroup,
              quadgroup_index_in_threadgroup, quadgroups_per_threadgroup,
              simdgroup_index_in_threadgroup, simdgroups_per_threadgroup, thread_execution_width,
              thread_index_in_quadgroup, thread_index_in_simdgroup, thread_index_in_threadgroup,
              threads_per_simdgroup};
for (int k = 0; k < 11; ++k) o[27 + k] = s[k];
"""


def test_all_attributes_on_a_non_uniform_3d_grid():
    G, T = np.array([37, 3, 2]), np.array([16, 2, 2])
    k = metal_kernel("attrs", ["x"], ["out"], _ATTR_KERNEL, options=SimOptions(check_coverage=True))
    out, = k(inputs=[mx.zeros(8)], grid=tuple(int(g) for g in G),
             threadgroup=tuple(int(t) for t in T), output_shapes=[(int(G.prod()), 38)],
             output_dtypes=[mx.uint32])
    out = np.array(out)
    D = np.minimum(T, G)
    N = -(-G // D)

    def ceil(a, b):
        return -(-a // b)
    for z in range(G[2]):
        for y in range(G[1]):
            for x in range(G[0]):
                pos = np.array([x, y, z])
                g = pos // D
                p = pos - g * D
                A = np.minimum(D, G - g * D)
                t = p[0] + p[1] * A[0] + p[2] * A[0] * A[1]
                n, nd = A.prod(), D.prod()
                v3 = [D, [0, 0, 0], G, pos, p, g, N, G, A]
                s = [ceil(nd, 4), ceil(nd, 32), t // 4, ceil(n, 4), t // 32, ceil(n, 32), 32,
                     t % 4, t % 32, t, 32]
                gid = x + y * G[0] + z * G[0] * G[1]
                np.testing.assert_array_equal(out[gid], np.concatenate([np.ravel(v3), s]),
                                              err_msg=str(pos))


_TYPES = """
uint i = thread_position_in_grid.x;
float4 v = float4(x[4 * i], x[4 * i + 1], x[4 * i + 2], x[4 * i + 3]);
float4 w = v.wzyx;
w.xy = v.zw * 2.0h;
w.z += 1.5h;
half4 h = half4(w);
for (int k = 0; k < 4; ++k) out[4 * i + k] = float(h[k]);
bf[i] = bfloat16_t(x[4 * i]);
hf[i] = float16_t(x[4 * i + 1]);
info[4 * i] = as_type<uint>(v.x);
info[4 * i + 1] = sizeof(float3) * 100 + sizeof(packed_float3);
info[4 * i + 2] = ceildiv(i + 5, 4u);
info[4 * i + 3] = Limits<float>::finite_max == 3.4028234663852886e38f ? 1 : 0;
"""


def test_vectors_swizzles_literals_and_conversions():
    n = 37
    x = RNG.standard_normal(4 * n).astype(np.float32)
    # bfloat16 ties (low 16 bits exactly 0x8000) and NaN: round to nearest even, NaN stays NaN
    x[0], x[4], x[8] = np.array([0x3F808000, 0x3F818000, 0x7FC00001], np.uint32).view(np.float32)
    k = sim("types", ["x"], ["out", "bf", "hf", "info"], _TYPES)
    out, bf, hf, info = k(inputs=[mx.array(x)], grid=(n, 1, 1), threadgroup=(32, 1, 1),
                          output_shapes=[(4 * n,), (n,), (n,), (4 * n,)],
                          output_dtypes=[mx.float32, mx.bfloat16, mx.float16, mx.uint32])
    v = x.reshape(n, 4)
    w = np.stack([v[:, 2] * 2, v[:, 3] * 2, v[:, 1] + 1.5, v[:, 0]], 1)
    w = w.astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(np.array(out).reshape(n, 4), w)
    got_bf = np.asarray(bf.view(mx.uint16))
    assert (got_bf[0], got_bf[1]) == (0x3F80, 0x3F82)  # ties to even
    assert (got_bf[2] & 0x7F80) == 0x7F80 and (got_bf[2] & 0x7F) != 0  # NaN stays NaN
    np.testing.assert_array_equal(got_bf[3:], bf16_bits(v[3:, 0]))
    np.testing.assert_array_equal(np.array(hf), v[:, 1].astype(np.float16))
    info = np.array(info).reshape(n, 4)
    np.testing.assert_array_equal(info[:, 0], v[:, 0].view(np.uint32))
    assert (info[:, 1] == 1612).all() and (info[:, 3] == 1).all()
    np.testing.assert_array_equal(info[:, 2], (np.arange(n) + 5 + 3) // 4)


def test_strided_inputs_with_elem_to_loc():
    """MLX's documented example with ensure_row_contiguous=False: transposed, sliced and
    broadcast inputs."""
    src = """
    uint elem = thread_position_in_grid.x;
    T tmp = inp[elem_to_loc(elem, inp_shape, inp_strides, inp_ndim)];
    out[elem] = metal::exp(tmp);
    """
    k = metal_kernel("strided_exp", ["inp"], ["out"], src, ensure_row_contiguous=False,
                     options=SimOptions(check_coverage=True))
    base = mx.array(RNG.standard_normal((6, 10)).astype(np.float32))
    for a in (base.T, base[1:, ::3], mx.broadcast_to(base[2], (5, 10))):
        out, = k(inputs=[a], template=[("T", mx.float32)], grid=(a.size, 1, 1),
                 threadgroup=(64, 1, 1), output_shapes=[a.shape], output_dtypes=[mx.float32])
        np.testing.assert_allclose(np.array(out), np.exp(np.array(a)), rtol=1e-6)


# ------------------------------------------------------------------------------ detectors
_SHIFT = """
threadgroup float buf[TG];
uint t = thread_index_in_threadgroup;
buf[t] = x[thread_position_in_grid.x];
{barrier}
out[thread_position_in_grid.x] = buf[(t + 1) % TG];
"""


def test_missing_barrier_is_caught():
    x = RNG.standard_normal(96).astype(np.float32)
    args = dict(inputs=[mx.array(x)], template=[("TG", 32)], grid=(96, 1, 1),
                threadgroup=(32, 1, 1), output_shapes=[(96,)], output_dtypes=[mx.float32])
    good = _SHIFT.format(barrier="threadgroup_barrier(mem_flags::mem_threadgroup);")
    out, = racy("shift", ["x"], ["out"], good)(**args)
    np.testing.assert_array_equal(np.array(out), np.roll(x.reshape(3, 32), -1, axis=1).ravel())

    bad = _SHIFT.format(barrier="")
    # Threadgroup memory starts as NaN: reading a slot nobody wrote yet shows up in the output.
    out, = sim("shift", ["x"], ["out"], bad)(**args)
    assert np.isnan(np.array(out)).any()
    # Without poison, the reverse / shuffled lane order gives a different result.
    with pytest.raises(KernelRuntimeError, match="race: output 'out' differs"):
        metal_kernel("shift", ["x"], ["out"], bad,
                     options=SimOptions(poison=False, check_races=True))(**args)


def test_unwritten_output_is_caught():
    src = "uint i = thread_position_in_grid.x; if (i % 7 != 3) out[i] = x[i];"
    args = dict(inputs=[mx.zeros(40)], grid=(40, 1, 1), threadgroup=(32, 1, 1),
                output_shapes=[(40,)], output_dtypes=[mx.float32])
    out, = sim("holes", ["x"], ["out"], src)(**args)
    assert np.isnan(np.array(out)[3]) and np.array(out)[4] == 0
    with pytest.raises(KernelRuntimeError, match="never written.*first at flat index 3"):
        racy("holes", ["x"], ["out"], src)(**args)


@pytest.mark.parametrize("src, message", [
    ("if (thread_index_in_threadgroup < 16) { threadgroup_barrier(mem_flags::mem_threadgroup); }\n"
     "else { threadgroup_barrier(mem_flags::mem_threadgroup); }\nout[0] = 1;",
     r"divergent threadgroup_barrier: threads wait at \[source:1\] and at \[source:2\]"),
    ("uint i = thread_position_in_grid.x;\nif (i >= 40) return;\n"
     "threadgroup_barrier(mem_flags::mem_threadgroup);\nout[i] = 1;",
     r"\[source:3\].*threadgroup_barrier reached after 24 of 32 threads returned"),
    ("threadgroup float big[9000];\nbig[thread_index_in_threadgroup] = 1;\nout[0] = big[0];",
     r"threadgroup memory of 36000 bytes exceeds the limit of 32768"),
    ("out[thread_position_in_grid.x] = 1;",
     r"out-of-bounds write: the guard band past its end of output 'out'"),
])
def test_detectors(src, message):
    k = sim("detect", ["x"], ["out"], src)
    with pytest.raises(KernelRuntimeError, match=message):
        k(inputs=[mx.zeros(8)], grid=(64, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(48,)],
          output_dtypes=[mx.float32])


def test_compile_errors_point_at_the_metal_source():
    src = "uint i = thread_position_in_grid.x;\nout[i] = inp[i] * s;"
    k = sim("scalar_as_array", ["inp", "s"], ["out"], src)
    args = dict(grid=(8, 1, 1), threadgroup=(8, 1, 1), output_shapes=[(8,)],
                output_dtypes=[mx.float32])
    out, = k(inputs=[mx.ones(8), 2.0], **args)  # a scalar binds as `const constant float&`
    np.testing.assert_array_equal(np.array(out), 2.0)
    with pytest.raises(MetalCompileError, match=r"\[source:2:\d+\].*invalid operands"):
        k(inputs=[mx.ones(8), mx.array([2.0])], **args)  # a 1-element array binds as a pointer
    with pytest.raises(MetalCompileError, match=r"\[header:2:\d+\]"):
        sim("bad_header", ["inp"], ["out"], "out[0] = 1;",
            header="// helpers\nint f() { return nope; }\n")(inputs=[mx.ones(8)], **args)


# ------------------------------------------------------------------------------ atomics
def test_device_atomics_histogram_and_float_sum():
    src = """
    uint i = thread_position_in_grid.x;
    if (i < idx_shape[0]) {
      atomic_fetch_add_explicit(&hist[idx[i]], 1u, memory_order_relaxed);
      atomic_fetch_add_explicit(&total[0], 1u + idx[i], memory_order_relaxed);
    }
    """
    idx = RNG.integers(0, 17, size=1003).astype(np.int32)
    k = metal_kernel("histogram", ["idx"], ["hist", "total"], src, atomic_outputs=True,
                     options=SimOptions(workers=2, check_races=True))
    hist, total = k(inputs=[mx.array(idx)], grid=(1024, 1, 1), threadgroup=(64, 1, 1),
                    output_shapes=[(17,), (1,)], output_dtypes=[mx.uint32, mx.uint32], init_value=0)
    np.testing.assert_array_equal(np.array(hist), np.bincount(idx, minlength=17))
    assert int(np.array(total)[0]) == int((idx + 1).sum())

    fsrc = ("uint i = thread_position_in_grid.x; "
            "atomic_fetch_add_explicit(&acc[i % 3], x[i], memory_order_relaxed);")
    x = RNG.standard_normal(999).astype(np.float32)
    acc, = sim("float_atomic", ["x"], ["acc"], fsrc, atomic_outputs=True)(
        inputs=[mx.array(x)], grid=(999, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(3,)],
        output_dtypes=[mx.float32], init_value=0.5)
    np.testing.assert_allclose(np.array(acc), x.reshape(-1, 3).sum(0) + 0.5, rtol=1e-4, atol=1e-4)


def test_threadgroup_atomics():
    src = """
    threadgroup atomic_uint count;
    uint t = thread_index_in_threadgroup;
    if (t == 0) atomic_store_explicit(&count, 0u, memory_order_relaxed);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (x[thread_position_in_grid.x] > 0.0f)
        atomic_fetch_add_explicit(&count, 1u, memory_order_relaxed);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (t == 0)
        out[threadgroup_position_in_grid.x] = atomic_load_explicit(&count, memory_order_relaxed);
    """
    x = RNG.standard_normal(320).astype(np.float32)
    out, = racy("tg_atomic", ["x"], ["out"], src)(
        inputs=[mx.array(x)], grid=(320, 1, 1), threadgroup=(64, 1, 1), output_shapes=[(5,)],
        output_dtypes=[mx.uint32])
    np.testing.assert_array_equal(np.array(out), (x.reshape(5, 64) > 0).sum(1))


# ------------------------------------------------------------------------------ builder
def test_builder_reads_package_text_and_takes_the_factory():
    pkg = "tests.metal_sim.examples"
    k = build_kernel("scaled_rowsum", ["x", "scale"], ["out"], "scaled_rowsum.metal",
                     header_files=("example.h",), factory=racy, package=pkg)
    assert k.spec.source == metal_text("scaled_rowsum.metal", pkg)
    assert k.spec.header == metal_text("example.h", pkg)
    x = mx.array(RNG.standard_normal((5, 77)).astype(np.float32)).astype(mx.bfloat16)
    out, = k(inputs=[x, 0.5], template=[("T", mx.float32), ("TG", 64)], grid=(64, 5, 1),
             threadgroup=(64, 1, 1), output_shapes=[(5,)], output_dtypes=[mx.float32])
    np.testing.assert_allclose(np.array(out), np.array(x.astype(mx.float32)).sum(1) * 0.5,
                               rtol=1e-5, atol=1e-5)
    # Production's factory (mx.fast.metal_kernel) builds from the same text; on Linux only the
    # call fails.
    assert callable(build_kernel("scaled_rowsum", ["x", "scale"], ["out"], "scaled_rowsum.metal",
                                 header_files=("example.h",), package=pkg))


_SURFACE_HEADER = """
#include <metal_stdlib>
using namespace metal;
constant constexpr float kTable[4] = {0.5f, 1.0f, 2.0f, 4.0f};
struct Pair {
  float a, b;
  float sum() const thread { return a + b; }
};
template <typename T>
METAL_FUNC T twice(T v) { return v * T(2); }
"""

_SURFACE = """
uint i = thread_position_in_grid.x;
float v = x[i];
device float* o = out + i * 16;
o[0] = metal::precise::sqrt(fabs(v)) + metal::fast::exp(-fabs(v));
o[1] = clamp(v, -0.5f, 0.5f) + saturate(v) + step(0.0f, v);
o[2] = select(1.0f, 2.0f, v > 0.0f) * kTable[i % 4];
o[3] = mix(v, 2.0f * v, 0.25f) + fma(v, 3.0f, 1.0f);
o[4] = float(popcount(uint(i)) + clz(uint(i) + 1u) + ctz(uint(i) | 256u));
o[5] = float(extract_bits(uint(i) * 2654435761u, 3u, 7u));
o[6] = Pair{v, 1.0f}.sum() + twice(v) + float(twice(int(i)));
float3 p = float3(v, 1.0f, 2.0f);
packed_float3 pp = p;
o[7] = dot(p, float3(pp)) + length(float2(3.0f, 4.0f));
int2 q = int2(int(i), -3) * 2 + 1;
o[8] = float(q.x + q.y) + float(max3(1, int(i), 5)) + float(min(q.x, 7));
half h = half(v) * 1.5h;
o[9] = float(h);
bfloat16_t b = bfloat16_t(v);
b += 1;
o[10] = float(b) + float(-b);
o[11] = float(quad_sum(int(i))) + float(quad_broadcast(int(i), 2));
o[12] = float(simd_shuffle(int64_t(i) << 33, 5) >> 33) + float(simd_shuffle(i % 2 == 0, 3));
o[13] = as_type<float>(as_type<uint>(v) ^ 0x80000000u);
o[14] = isnan(v / 0.0f) ? 1.0f : (isinf(v / 0.0f) ? 2.0f : 3.0f);
o[15] = float(rint(2.5f)) + float(round(2.5f)) + fract(-0.25f);
"""


def test_msl_surface_compiles_and_matches_numpy():
    """A broad slice of the MSL shim: math namespaces, header constants/structs/templates, vectors,
    packed types, integer functions, half/bfloat arithmetic, quad ops, 64-bit and bool shuffles."""
    n = 64
    x = RNG.standard_normal(n).astype(np.float32)
    x[3] = 0.0
    out, = sim("surface", ["x"], ["out"], _SURFACE, header=_SURFACE_HEADER)(
        inputs=[mx.array(x)], grid=(n, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(n, 16)],
        output_dtypes=[mx.float32])
    o = np.array(out)
    i = np.arange(n)
    f = np.float32
    clz = np.array([32 - int(k + 1).bit_length() for k in i])
    ctz = np.array([(int(k) | 256) & -(int(k) | 256) for k in i]).astype(np.int64)
    ctz = np.log2(ctz).astype(int)
    expect = {
        0: np.sqrt(np.abs(x)) + np.exp(-np.abs(x)),
        1: np.clip(x, -0.5, 0.5) + np.clip(x, 0, 1) + (x >= 0),
        2: np.where(x > 0, 2.0, 1.0) * np.array([0.5, 1, 2, 4])[i % 4],
        3: (x + 0.25 * x) + (x * 3 + 1),
        4: [bin(k).count("1") for k in i] + clz + ctz,
        5: ((i.astype(np.uint64) * 2654435761) % 2**32 >> 3) & 127,
        6: x + 1 + 2 * x + 2 * i,
        7: x * x + 1 + 4 + 5,
        8: (2 * i + 1) + (-5) + np.maximum(np.maximum(1, i), 5) + np.minimum(2 * i + 1, 7),
        9: (x.astype(np.float16) * np.float16(1.5)).astype(np.float32),
        10: np.zeros(n),  # b + (-b) is exactly 0
        11: i.reshape(-1, 4).sum(1).repeat(4) + (i - i % 4 + 2),
        12: (i - i % 32 + 5) + ((i - i % 32 + 3) % 2 == 0),
        13: -x,
        14: np.where(x == 0, 1.0, 2.0),
        15: np.full(n, 2 + 3 + 0.75),
    }
    for col, ref in expect.items():
        np.testing.assert_allclose(o[:, col], np.asarray(ref, dtype=f), rtol=2e-6, atol=1e-6,
                                   err_msg=f"column {col}")
