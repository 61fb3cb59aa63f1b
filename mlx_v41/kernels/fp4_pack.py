"""FP4 packing of compressed cache rows: main-KV rows (fp4_e4m3, 16 per E4M3 scale) and index-key
rows (fp4_e8m0, 32 per E8M0 scale) into the byte layouts of quant.pack_fp4_*.

The Metal kernel (metal/fp4_pack.metal) runs one thread per scale group and replaces the ops'
52 (index) / 81 (main KV) un-fused MLX launches with one; its bytes equal the ops' bytes.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from ..numerics.quant import FP4_E4M3_BLOCK, FP4_E8M0_BLOCK, pack_fp4_e4m3, pack_fp4_e8m0
from .check import assert_equal
from .spec import KernelSpec

KINDS = {"kv": (FP4_E4M3_BLOCK, True), "index": (FP4_E8M0_BLOCK, False)}  # group, E4M3 scale
_FLOAT_DTYPES = (mx.bfloat16, mx.float16, mx.float32)
_THREADS = 256  # threads per threadgroup; element-wise, so any edge group size works


def packed_width(width: int, kind: str) -> int:
    """Bytes of one packed row of `width` channels: width/2 code bytes + one scale per group."""
    group, _ = KINDS[kind]
    return width // 2 + width // group


def fp4_pack_ops(rows: mx.array, kind: str) -> mx.array:
    """Reference: rows [..., W] float -> uint8 [..., packed_width(W, kind)] (pure MLX)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {sorted(KINDS)}, got {kind!r}")
    return pack_fp4_e4m3(rows) if kind == "kv" else pack_fp4_e8m0(rows)


def _launch(kernel, rows: mx.array, kind: str) -> mx.array:
    group, is_e4m3 = KINDS[kind]
    *lead, width = rows.shape
    x = rows.reshape(-1, width)
    threads = x.shape[0] * (width // group)
    out, = kernel(inputs=[x], template=[("G", group), ("E4M3", is_e4m3)],
                  grid=(threads, 1, 1), threadgroup=(min(_THREADS, threads), 1, 1),
                  output_shapes=[(x.shape[0], packed_width(width, kind))],
                  output_dtypes=[mx.uint8])
    return out.reshape(*lead, packed_width(width, kind))


def _probe(run, ops) -> None:
    """One main-KV and one index-key block of rows: bytes equal to the ops'."""
    x = mx.sin(mx.arange(4 * 64, dtype=mx.float32) * 0.37).reshape(4, 64) * 7
    for kind in KINDS:
        assert_equal(f"fp4_pack {kind}", run(x, kind), ops(x, kind))


# The kernel as `run(rows, kind)`: metal/fp4_pack.metal, one thread per scale group.
FP4_PACK = KernelSpec("v41_fp4_pack", "fp4_pack", ("x",), ("out",), "fp4_pack.metal", _launch,
                      _probe, fp4_pack_ops, headers=("v41_common.h",))


def fp4_pack(rows: mx.array, kind: str, use_kernel: Optional[bool] = None, run=None) -> mx.array:
    """Pack cache rows into FP4 bytes.

    Args:
        rows: [..., W] bf16/f16/f32, W a multiple of 16 ("kv") or 32 ("index").
        kind: "kv" (fp4_e4m3: W/2 + W/16 bytes) or "index" (fp4_e8m0: W/2 + W/32 bytes).
        use_kernel: use the Metal kernel when it applies.
        run: an already built kernel (`FP4_PACK.build(factory)`) to use unconditionally, e.g. the
            Metal simulator's in tests.
    Returns:
        uint8 [..., packed row bytes], identical to `fp4_pack_ops`.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {sorted(KINDS)}, got {kind!r}")
    run = FP4_PACK.choose(use_kernel, run, applies=(
        rows.dtype in _FLOAT_DTYPES and rows.ndim > 0 and rows.size > 0
        and rows.shape[-1] % KINDS[kind][0] == 0))
    if run is None:
        return fp4_pack_ops(rows, kind)
    return run(rows, kind)
