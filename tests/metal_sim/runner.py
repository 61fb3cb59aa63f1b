"""Buffers, the ctypes call and the post-run checks (design note, 3.7-3.8)."""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .errors import KernelRuntimeError

GUARD = 64  # bytes of guard band on each side of every buffer
GUARD_BYTE = 0xA5
STATS = ("groups", "fiber_switches", "partial_simd_ops", "barriers_after_exit",
         "inactive_lane_reads", "tg_bytes_max", "barriers", "simd_ops")
SCHEDULES = {"forward": 0, "reverse": 1, "shuffle": 2}


class LaunchParams(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_int64 * 3), ("tg", ctypes.c_int64 * 3),
                ("schedule", ctypes.c_int32), ("workers", ctypes.c_int32),
                ("seed", ctypes.c_uint64), ("fibers", ctypes.c_int32),
                ("poison", ctypes.c_int32), ("strict", ctypes.c_int32),
                ("stack_kib", ctypes.c_int32),
                ("tg_mem_limit", ctypes.c_int64), ("shuffle_groups", ctypes.c_int32),
                ("reserved", ctypes.c_int32)]


class LaunchResult(ctypes.Structure):
    _fields_ = [("err", ctypes.c_char * 2048), ("stats", ctypes.c_int64 * len(STATS))]


_NP_DTYPES = {
    mx.bool_: np.bool_, mx.uint8: np.uint8, mx.uint16: np.uint16, mx.uint32: np.uint32,
    mx.uint64: np.uint64, mx.int8: np.int8, mx.int16: np.int16, mx.int32: np.int32,
    mx.int64: np.int64,
    mx.float16: np.float16, mx.bfloat16: np.uint16, mx.float32: np.float32,
}


def np_dtype(dtype: mx.Dtype):
    """Storage dtype on the numpy side (bfloat16 travels as uint16)."""
    if dtype not in _NP_DTYPES:
        raise TypeError(f"[metal_kernel] {dtype} buffers are not supported on Apple GPUs")
    return np.dtype(_NP_DTYPES[dtype])


def to_numpy_view(a: mx.array) -> np.ndarray:
    """A zero-copy numpy view carrying MLX's real strides (bfloat16 as uint16)."""
    np_dtype(a.dtype)
    return np.asarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)


class Buffer:
    """A uint8 block laid out as guard + payload (64-byte aligned) + guard."""

    def __init__(self, payload: bytes | np.ndarray | None, nbytes: int, fill: int = 0):
        self.nbytes = nbytes
        self.block = np.full(nbytes + 3 * GUARD, GUARD_BYTE, dtype=np.uint8)
        base = self.block.ctypes.data
        self.start = (-(base + GUARD) % GUARD) + GUARD
        view = self.payload()
        if payload is None:
            view[:] = fill
        elif nbytes:
            view[:] = np.frombuffer(payload, dtype=np.uint8, count=nbytes)

    @property
    def ptr(self) -> int:
        return self.block.ctypes.data + self.start

    def payload(self) -> np.ndarray:
        return self.block[self.start: self.start + self.nbytes]

    def guards_intact(self) -> tuple[bool, bool]:
        before = self.block[self.start - GUARD: self.start]
        after = self.block[self.start + self.nbytes: self.start + self.nbytes + GUARD]
        return bool((before == GUARD_BYTE).all()), bool((after == GUARD_BYTE).all())


@dataclass
class Binding:
    buffer: Buffer
    what: str  # for messages: "input 'x'", "x_shape", "output 'out'"


def input_bindings(names, arrays, shape_infos, ensure_row_contiguous: bool) -> list[Binding]:
    """Input buffers in MLX's binding order: data, then shape / strides / ndim when used."""
    out = []
    for name, a, (has_shape, has_strides, has_ndim) in zip(names, arrays, shape_infos):
        v = to_numpy_view(a)
        item = v.dtype.itemsize
        if v.ndim == 0:
            out.append(Binding(Buffer(np.array(v).tobytes(), item), f"input '{name}'"))
            continue
        if ensure_row_contiguous or v.size == 0:
            c = np.ascontiguousarray(v)
            data = c.tobytes()
            strides = [s // item for s in c.strides]
            buf = Buffer(data, len(data))
        else:
            # Bind the view as it is: copy the byte span it covers and point at its first element.
            lo = sum(min(0, (n - 1) * s) for n, s in zip(v.shape, v.strides))
            hi = sum(max(0, (n - 1) * s) for n, s in zip(v.shape, v.strides)) + item
            span = (ctypes.c_uint8 * (hi - lo)).from_address(v.ctypes.data + lo)
            buf = _OffsetBuffer(bytes(span), -lo)
            strides = [s // item for s in v.strides]
        out.append(Binding(buf, f"input '{name}'"))
        if has_shape:
            s = np.array(v.shape, dtype=np.int32).tobytes()
            out.append(Binding(Buffer(s, len(s)), f"{name}_shape"))
        if has_strides:
            s = np.array(strides, dtype=np.int64).tobytes()
            out.append(Binding(Buffer(s, len(s)), f"{name}_strides"))
        if has_ndim:
            s = np.array(v.ndim, dtype=np.int32).tobytes()
            out.append(Binding(Buffer(s, len(s)), f"{name}_ndim"))
    return out


class _OffsetBuffer(Buffer):
    """A buffer whose kernel pointer is ``offset`` bytes into the payload (negative strides)."""

    def __init__(self, payload: bytes, offset: int):
        super().__init__(payload, len(payload))
        self.offset = offset

    @property
    def ptr(self) -> int:
        return self.block.ctypes.data + self.start + self.offset


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even, NaN kept quiet."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), r)


def output_buffer(shape, dtype: mx.Dtype, init_value, fill_byte: int) -> Buffer:
    nd = np_dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
    if init_value is None:
        return Buffer(None, n * nd.itemsize, fill_byte)
    if dtype == mx.bfloat16:
        v = _bf16_bits(np.full(n, init_value, dtype=np.float32))
    elif dtype == mx.bool_:
        v = np.full(n, init_value != 0, dtype=np.bool_)
    else:
        v = np.full(n, np.float32(init_value)).astype(nd)
    return Buffer(v.tobytes(), n * nd.itemsize)


def to_mx(payload: np.ndarray, shape, dtype: mx.Dtype) -> mx.array:
    a = np.frombuffer(payload.tobytes(), dtype=np_dtype(dtype)).reshape(tuple(shape))
    if dtype == mx.bfloat16:
        return mx.array(a).view(mx.bfloat16)
    return mx.array(a)


@dataclass
class LaunchConfig:
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    schedule: str
    workers: int
    seed: int
    fibers: bool
    poison: bool
    strict: bool
    stack_kib: int
    tg_mem_limit: int
    shuffle_groups: bool = False


def launch(lib, inputs: list[Binding], make_outputs, cfg: LaunchConfig,
           remap) -> tuple[list[Buffer], dict]:
    """One run over fresh output buffers (``make_outputs()``); returns (outputs, stats)."""
    fibers = cfg.fibers
    while True:
        outputs = make_outputs()
        bindings = inputs + outputs
        ptrs = (ctypes.c_void_p * max(1, len(bindings)))(*[b.buffer.ptr for b in bindings])
        p = LaunchParams((ctypes.c_int64 * 3)(*cfg.grid), (ctypes.c_int64 * 3)(*cfg.threadgroup),
                         SCHEDULES[cfg.schedule], cfg.workers, cfg.seed, int(fibers),
                         int(cfg.poison), int(cfg.strict), cfg.stack_kib, cfg.tg_mem_limit,
                         int(cfg.shuffle_groups), 0)
        r = LaunchResult()
        t0 = time.perf_counter()
        rc = lib.msim_run(ptrs, ctypes.byref(p), ctypes.byref(r))
        seconds = time.perf_counter() - t0
        if rc == 2 and not fibers:  # a synchronising call was reached in direct mode
            fibers = True
            continue
        break
    stats = dict(zip(STATS, r.stats))
    stats.update(seconds=seconds, fibers=fibers)
    if rc != 0:
        raise KernelRuntimeError("metal_sim: " + remap(r.err.decode(errors="replace")))
    for b in bindings:
        before, after = b.buffer.guards_intact()
        if not (before and after):
            side = "before its start" if not before else "past its end"
            raise KernelRuntimeError(f"metal_sim: out-of-bounds write: the guard band {side} of "
                                     f"{b.what} was overwritten")
    return outputs, stats


def first_difference(a: np.ndarray, b: np.ndarray, itemsize: int) -> tuple[int, int]:
    """(number of differing elements, first differing flat index), compared bit for bit."""
    x = a.reshape(-1, itemsize) if itemsize else a
    y = b.reshape(-1, itemsize) if itemsize else b
    diff = (x != y).any(axis=1)
    idx = np.flatnonzero(diff)
    return len(idx), int(idx[0]) if len(idx) else -1
