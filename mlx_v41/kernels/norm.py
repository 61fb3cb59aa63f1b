"""The RMSNorm family of a decoder layer as one fused kernel per call: [mHC
`collapse` ->] RMSNorm [-> RoPE] [-> act_fp8]. On the Metal path each norm of the ops is three
launches (the pairwise squares, a Sum, the normalising kernel) and its neighbours one each
(collapse, RoPE, act_fp8); metal/norm.metal does a chain in one launch per call, one
threadgroup per token row. The five chains of a layer and the model's end:

* attention input: `input_layernorm(collapse(streams, pre))` and its act_fp8 (the input that
  `kv_proj` / `q_a_proj` prepare);
* FFN input: `post_attention_layernorm.pair(collapse(streams, pre))` and its act_fp8 (the
  experts' input);
* kv: act_fp8 (bf16) of `rope(kv_norm.of_products(products))`;
* q: `q_a_norm.of_products(products)` and its act_fp8 (`q_b_proj`'s input);
* the final `norm(collapse(streams, pre))`.

Tolerance: the kernel sums the squares in `_pairwise_mean`'s order and runs every other step
as the ops do, so on the CPU simulator its outputs equal the ops' bits; on a GPU the ops' own
reductions and rsqrt differ, so the check allows each bf16 value one ulp and a few of them to
differ (`FLIP_FRACTION`), and holds act_fp8 outputs to the kernel's own bf16 values exactly.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import mlx.core as mx

from ..numerics.fp8_activation import act_fp8_qdq
from ..numerics.mhc import collapse
from ..numerics.norm import PAIRWISE_LEAF, rms_norm, rms_norm_pair
from ..numerics.quant import ACT_FP8_BLOCK
from ..numerics.rope import RoPE
from .act_fp8 import act_fp8
from .check import KernelMismatch
from .rope_products import angles_of, check_row_count, ops_positions, positions_fit
from .spec import KernelSpec

OUTPUTS = ("y", "y32", "fp8")  # the bf16 result, its fp32 copy, its act_fp8 rounding
ROW_THREADS = 256  # threads per row: the width is halved down to this (a pairwise level each)
METAL_THREADS = 1024  # Metal's threadgroup limit: widths that need more take the ops
FLIP_FRACTION = 2.0 ** -6  # of a result's bf16 values that may differ from the ops (by 1 ulp)
_FLOAT_DTYPES = (mx.bfloat16, mx.float16, mx.float32)
_UNUSED = (1,)  # the shape of an output not asked for (the kernel zeroes its one element)


def norm_ops(x, weight, eps, pre=None, products=False, rope=None, positions=None,
             outputs: Sequence[str] = ("y",), fp8_dtype=mx.float32, rounding=act_fp8_qdq) -> tuple:
    """Reference: the model's own functions in the model's order (`collapse`, the RMSNorm's
    compiled forms, `RoPE.__call__`, `act_fp8_qdq`); arguments as in `norm`. `rounding`: the
    act_fp8 step (`norm`'s unfused path passes the act_fp8 dispatcher: the same bits)."""
    _check_outputs(outputs)
    if pre is not None:
        x = collapse(x, pre)
    y32 = None
    if "y32" in outputs and not products and rope is None:
        y, y32 = rms_norm_pair(x, weight, eps)  # the fused pair the FFN input runs today
    else:
        y = rms_norm(x, weight, eps, products)
    if rope is not None:
        y = rope(y, ops_positions(positions))
    results = {"y": y}
    if "y32" in outputs:
        results["y32"] = y.astype(mx.float32) if y32 is None else y32
    if "fp8" in outputs:
        results["fp8"] = rounding(y, fp8_dtype, False)
    return tuple(results[name] for name in outputs)


def _check_outputs(outputs: Sequence[str]) -> None:
    if not outputs or any(name not in OUTPUTS for name in outputs):
        raise ValueError(f"norm: outputs must be a non-empty selection of {OUTPUTS}, got "
                         f"{tuple(outputs)}")


def threads_for(width: int) -> Optional[int]:
    """Threads per row for a `width`-channel norm, or None where the kernel does not apply:
    the width halved while above ROW_THREADS and the half still a multiple of 32 (each halving
    is a level of the pairwise sum, done in registers), at most METAL_THREADS; the width itself a
    multiple of 32 (act_fp8 blocks, whole simdgroups)."""
    if width <= 0 or width % ACT_FP8_BLOCK:
        return None
    threads = width
    while threads > ROW_THREADS and threads % (2 * ACT_FP8_BLOCK) == 0:
        threads //= 2
    return threads if threads <= METAL_THREADS else None


def _launch(kernel, x, weight, eps, pre=None, products=False, rope=None, positions=None,
            outputs: Sequence[str] = ("y",), fp8_dtype=mx.float32) -> tuple:
    _check_outputs(outputs)
    width = x.shape[-1]
    lead = x.shape[:-2] if pre is not None else x.shape[:-1]
    copies = x.shape[-2] if pre is not None else 0
    rows = x.size // width // max(copies, 1)
    threads = threads_for(width)
    if threads is None:
        raise ValueError(f"norm kernel: width {width} is not one it plans (`threads_for`)")
    cos, sin = _rotation(rope, positions, x.shape[1] if x.ndim > 1 else 1)
    wanted = [name in outputs for name in OUTPUTS]
    shapes = [(rows, width) if w else _UNUSED for w in wanted]
    y, y32, q8 = kernel(
        inputs=[x.reshape(rows, copies, width) if copies else x.reshape(rows, width),
                _rows_of(pre, rows, copies), weight.astype(mx.float32), cos, sin, float(eps)],
        template=[("N", copies), ("P", bool(products)), ("D", width), ("THREADS", threads),
                  ("LEAF", PAIRWISE_LEAF), ("R", rope.rope_dim if rope is not None else 0),
                  ("WY", wanted[0]), ("WY32", wanted[1]), ("WQ", wanted[2]), ("Q", fp8_dtype)],
        grid=(threads, rows, 1), threadgroup=(threads, 1, 1), output_shapes=shapes,
        output_dtypes=[mx.bfloat16, mx.float32, fp8_dtype])
    results = dict(zip(OUTPUTS, (y, y32, q8)))
    return tuple(results[name].reshape(*lead, width) for name in outputs)


def _rows_of(pre, rows: int, copies: int) -> mx.array:
    """`pre` as [rows, copies] fp32, or a placeholder where there is no collapse."""
    return _placeholder() if pre is None else pre.reshape(rows, copies).astype(mx.float32)


def _rotation(rope, positions, length: int):
    """(cos, sin) of the rows' positions, as `RoPE.__call__` reads `positions`: [S, rope_dim /
    2] shared by the batch rows (`RoPE.cos_sin`, shared by the layers of a call), or [B * S,
    rope_dim / 2] of per-row first positions (`rope_products.angles_of`); placeholders without
    RoPE."""
    if rope is None:
        return _placeholder(), _placeholder()
    return angles_of(rope, positions, length)


@functools.cache
def _placeholder() -> mx.array:
    placeholder = mx.zeros((8,), mx.float32)  # 8: bound as a device buffer like the others
    mx.eval(placeholder)
    return placeholder


def applies(x, weight, pre=None, rope=None, positions=None) -> bool:
    """Whether the kernel takes these inputs: a width `threads_for` plans, at least one row,
    float rows (bf16 copies to collapse, whose sum the collapse rounds to bf16); RoPE on an
    even tail of [B, S, D] rows at an int first position, an [S] array, or one first position
    per batch row (`rope_products.positions_fit`)."""
    width = x.shape[-1] if x.ndim else 0
    if threads_for(width) is None or x.size == 0 or weight.shape != (width,):
        return False
    if pre is not None and (x.dtype != mx.bfloat16 or x.ndim < 3
                            or pre.shape != x.shape[:-1]):
        return False
    if pre is None and x.dtype not in _FLOAT_DTYPES:
        return False
    if rope is None:
        return True
    rope_dim = rope.rope_dim
    return (x.ndim == 3 and pre is None and rope_dim % 2 == 0 and 0 < rope_dim <= width
            and (width - rope_dim) % 2 == 0 and positions_fit(positions, *x.shape[:2]))


def _probe(run, ops) -> None:
    """Two rows of 4 copies to collapse, 3 rows of fp32 products with RoPE on 16 of 64
    channels, and 2 batch rows of those from their own first positions (5 and 70001): within
    the tolerance of `check_close`."""
    wave = lambda n, f: mx.sin(mx.arange(n, dtype=mx.float32) * f)  # noqa: E731
    streams = (wave(2 * 4 * 128, 0.37) * 5).reshape(1, 2, 4, 128).astype(mx.bfloat16)
    pre = mx.abs(wave(8, 0.9)).reshape(1, 2, 4) + 0.25
    args = (streams, 1 + wave(128, 0.11) * 0.5, 1e-6)
    check_close("norm", run(*args, pre=pre, outputs=OUTPUTS),
                ops(*args, pre=pre, outputs=OUTPUTS), OUTPUTS)
    products = (wave(3 * 64, 0.53) * 40).reshape(1, 3, 64)
    rope = RoPE(16, 10000.0)
    kv = dict(products=True, rope=rope, positions=5, outputs=("y", "fp8"),
              fp8_dtype=mx.bfloat16)
    args = (products, 1 + wave(64, 0.3) * 0.25, 1e-6)
    check_close("norm rope", run(*args, **kv), ops(*args, **kv), ("y", "fp8"))
    args = (mx.concatenate([products, products[:, ::-1] * 0.5]), *args[1:])
    kv["positions"] = (5, 70001)
    check_close("norm rope per row", run(*args, **kv), ops(*args, **kv), ("y", "fp8"))


def check_close(name: str, got: tuple, want: tuple, outputs: Sequence[str]) -> None:
    """The kernel's stated tolerance: its bf16 result `y` within one bf16 ulp of the ops'
    everywhere and equal but for at most FLIP_FRACTION of its values; `y32` its exact fp32
    copy; `fp8` the act_fp8 of its own `y` (the ops' bits on the kernel's values). With
    `fp8` but no `y` asked for, the fp8 values as the ops' but for FLIP_FRACTION of them."""
    named = dict(zip(outputs, got))
    expected = dict(zip(outputs, want))
    for key in outputs:
        if named[key].shape != expected[key].shape or named[key].dtype != expected[key].dtype:
            raise KernelMismatch(f"{name} {key}: got {named[key].dtype} {named[key].shape}, "
                                 f"expected {expected[key].dtype} {expected[key].shape}")
    if "y" in named:
        y = named["y"]
        _within_ulp(f"{name} y", y, expected["y"])
        if "y32" in named and not mx.array_equal(named["y32"], y.astype(mx.float32)).item():
            raise KernelMismatch(f"{name} y32: not the fp32 copy of its y")
        if "fp8" in named:
            own = act_fp8_qdq(y, named["fp8"].dtype, False)
            if not mx.array_equal(named["fp8"], own).item():
                raise KernelMismatch(f"{name} fp8: not the act_fp8 of its own y")
    elif "fp8" in named:
        _few_differ(f"{name} fp8", named["fp8"], expected["fp8"])


def _within_ulp(name: str, got: mx.array, want: mx.array) -> None:
    g, w = got.astype(mx.float32), want.astype(mx.float32)
    # one bf16 ulp of w: 2^(exponent - 7), from the exponent bits (zero and subnormals: 2^-133)
    exponent = (w.view(mx.uint32) >> 23) & 0xFF
    ulp = mx.power(2.0, mx.maximum(exponent.astype(mx.float32), 1.0) - 134.0)
    if not (mx.abs(g - w) <= ulp).all().item() or not mx.isfinite(g).all().item():
        raise KernelMismatch(f"{name}: a value differs from its ops by more than one bf16 ulp")
    _few_differ(name, got, want)


def _few_differ(name: str, got: mx.array, want: mx.array) -> None:
    differ = (got.astype(mx.float32) != want.astype(mx.float32)).sum().item()
    if differ > FLIP_FRACTION * got.size:
        raise KernelMismatch(f"{name}: {differ} of {got.size} values differ from its ops "
                             f"(at most {FLIP_FRACTION:.3g} may)")


# The kernel as `run(x, weight, eps, pre, products, rope, positions, outputs, fp8_dtype)` (as
# `norm_ops`): metal/norm.metal, one threadgroup per token row.
NORM = KernelSpec("v41_norm", "norm", ("x", "pre", "weight", "rope_cos", "rope_sin", "eps"),
                  ("y", "y32", "q8"), "norm.metal", _launch, _probe, norm_ops,
                  headers=("v41_common.h",), exact=False)


def norm(x, weight, eps, pre=None, products=False, rope=None, positions=None,
         outputs: Sequence[str] = ("y",), fp8_dtype=mx.float32, use_kernel: Optional[bool] = None,
         run=None) -> tuple:
    """[collapse ->] RMSNorm [-> RoPE] of token rows, and the results asked for.

    Args:
        x: [..., D] rows (bf16, or fp32 products with `products`), or with `pre` the
            residual copies [..., n, D] bf16 to collapse first (`mhc.collapse`).
        weight: [D] the norm's fp32 weight; eps: its epsilon.
        pre: [..., n] fp32 collapse weights, or None.
        products: x holds fp32 projection products whose bf16 rounding is the activation
            (`RMSNorm.of_products`).
        rope: a `RoPE` rotating the last rope_dim channels of the normed [B, S, D] rows at
            `positions`: an int first position or an [S] array (both shared by every row of
            axis 0), or the first position of each row of axis 0, a tuple or list of B ints
            (as `RoPE.__call__` takes them) or an integer mx.array [B, 1] (rope_products.py).
        outputs: names from OUTPUTS: "y" the bf16 result, "y32" its fp32 copy, "fp8" its
            act_fp8 quantise-dequantise in `fp8_dtype`.
        use_kernel: use the Metal kernel when it applies.
        run: an already built kernel (`NORM.build(factory)`) to use where the kernel applies,
            e.g. the Metal simulator's in tests.
    Returns:
        The outputs asked for, in order, each [..., D]: the ops' values, or the kernel's within
        its tolerance (`check_close`).
    Raises:
        ValueError: per-row positions that do not give one first position per row of axis 0;
            outputs not from OUTPUTS.
    """
    if rope is not None:
        check_row_count("norm", positions, x.shape[0] if x.ndim else 0)
    given = use_kernel
    run = NORM.choose(use_kernel, run)
    args = (x, weight, eps, pre, products, rope, positions, outputs, fp8_dtype)
    if run is None or not applies(x, weight, pre, rope, positions):
        # the steps one by one, act_fp8 through its own dispatcher (its kernel where one is
        # active; the same bits as `norm_ops`)
        rounding = act_fp8 if given is None else functools.partial(act_fp8, use_kernel=given)
        return norm_ops(*args, rounding=rounding)
    return run(*args)
