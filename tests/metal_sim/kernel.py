"""The drop-in factory: ``metal_kernel(...)`` with MLX's signature, returning a ``SimKernel``."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

import mlx.core as mx

from . import build, generator, rewrite, runner
from .errors import KernelRuntimeError

_SYNC_RE = re.compile(r"\b(threadgroup_barrier|simdgroup_barrier|simd_\w+|quad_\w+)\b")


@dataclass(frozen=True)
class SimOptions:
    """How the simulator runs a kernel. Production code never passes this (tests bind it)."""

    schedule: str = "forward"  # lane order within a threadgroup: forward | reverse | shuffle
    seed: int = 0
    workers: int | None = None  # OS threads running threadgroups; default min(cores, 8)
    poison: bool = True  # outputs (without init_value) and threadgroup memory start as 0xFF bytes
    check_races: bool = False  # rerun in reverse and shuffled lane/group order; outputs must match
    check_coverage: bool = False  # rerun with 0x00 prefill; every output element must be written
    strict: bool = True  # partial-SIMD ops, barriers after return, inactive-lane reads are errors
    cxx: str | None = None  # compiler (default $METAL_SIM_CXX or g++)
    opt: str = "-O1"
    source: str = "auto"  # generated text: auto (MLX capture, else port) | mlx | port
    stack_kib: int = 256
    tg_mem_limit: int = 32768
    max_threads: int = 1024
    max_buffers: int = 31


_DEFAULT = SimOptions()


def _to_array(x) -> mx.array:
    """MLX's conversion of call inputs (python/src/utils.cpp `to_array`)."""
    if isinstance(x, mx.array):
        return x
    if isinstance(x, bool):
        return mx.array(x, dtype=mx.bool_)
    if isinstance(x, int):
        return mx.array(x, dtype=mx.int32 if -(2**31) <= x < 2**31 else mx.int64)
    if isinstance(x, float):
        return mx.array(x, dtype=mx.float32)
    return mx.array(x)


def _triple(v, what: str) -> tuple[int, int, int]:
    if not (isinstance(v, (tuple, list)) and len(v) == 3 and all(isinstance(i, int) for i in v)):
        raise TypeError(f"[metal_kernel] `{what}` must be a tuple of three ints, got {v!r}")
    return tuple(int(i) for i in v)


class SimKernel:
    """Callable like MLX's kernel object; runs the kernel's exact Metal text on the CPU.

    Debugging aids: ``last_source`` (Metal text), ``last_cpp`` (path of the C++ file) and
    ``last_stats`` (threadgroups, fiber switches, barrier and SIMD counters, run seconds).
    """

    def __init__(self, spec: generator.KernelSpec, options: SimOptions):
        self.spec = spec
        self.options = options
        self.last_source: str | None = None
        self.last_cpp = None
        self.last_stats: dict | None = None
        self._needs_fibers = bool(_SYNC_RE.search(spec.source) or _SYNC_RE.search(spec.header))

    def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None,
                 init_value=None, verbose=False, stream=None):
        spec, opt = self.spec, self.options
        inputs, output_shapes = list(inputs), list(output_shapes)
        output_dtypes = list(output_dtypes)
        for what, got in (("inputs", inputs), ("output_shapes", output_shapes),
                          ("output_dtypes", output_dtypes)):
            want = len(spec.input_names) if what == "inputs" else len(spec.output_names)
            if len(got) != want:
                raise ValueError(f"[metal_kernel] Expected `{what}` to have size {want} but got "
                                 f"size {len(got)}.\n")
        template = generator.check_template(template)
        grid, threadgroup = _triple(grid, "grid"), _triple(threadgroup, "threadgroup")
        arrays = [_to_array(x) for x in inputs]
        output_shapes = [tuple(int(d) for d in s) for s in output_shapes]
        metas = [generator.InputMeta(a.dtype, a.ndim, a.size) for a in arrays]

        for d in [a.dtype for a in arrays] + output_dtypes:
            runner.np_dtype(d)  # float64 / complex64 are rejected, as on Apple GPUs

        metal = generator.generate(spec, metas, output_dtypes, template, opt.source)
        self.last_source = metal
        if verbose:
            print(f"Generated source code for `{spec.name}`:\n```\n{metal}\n```")
        tg_threads = threadgroup[0] * threadgroup[1] * threadgroup[2]
        if tg_threads > opt.max_threads:
            raise ValueError(f"[metal_kernel] The requested threadgroup {threadgroup} has "
                             f"{tg_threads} threads, more than the maximum of {opt.max_threads} "
                             "per threadgroup.")
        if min(threadgroup) < 1 or min(grid) < 0:
            raise ValueError(f"[metal_kernel] Invalid grid {grid} or threadgroup {threadgroup}.")

        kname = generator.kernel_name(spec, metas, output_dtypes, template)
        lmap = rewrite.LineMap(metal, spec.header, spec.source, kname)
        cpp, params = rewrite.cpp_file(metal, kname, lmap.name)
        lib, self.last_cpp = build.compile_kernel(cpp, cxx=opt.cxx, opt=opt.opt, remap=lmap.remap)

        ins = runner.input_bindings(spec.input_names, arrays, spec.shape_infos(),
                                    spec.ensure_row_contiguous)
        nbufs = len(ins) + len(output_dtypes)
        if nbufs > opt.max_buffers:
            raise ValueError(f"[metal_kernel] The kernel binds {nbufs} buffers; Metal allows at "
                             f"most {opt.max_buffers} (shape/strides/ndim buffers count).")
        if lib.msim_nbufs() != nbufs:
            raise KernelRuntimeError(f"metal_sim: the generated signature declares "
                                     f"{lib.msim_nbufs()} buffers but {nbufs} are bound")

        def outputs(fill_byte=0xFF if opt.poison else 0x00):
            return lambda: [runner.Binding(runner.output_buffer(s, d, init_value, fill_byte),
                                           f"output '{n}'")
                            for n, s, d in zip(spec.output_names, output_shapes, output_dtypes)]

        workers = opt.workers or min(os.cpu_count() or 1, 8)
        cfg = runner.LaunchConfig(grid, threadgroup, opt.schedule, workers, opt.seed,
                                  self._needs_fibers, opt.poison, opt.strict, opt.stack_kib,
                                  opt.tg_mem_limit)
        outs, stats = runner.launch(lib, ins, outputs(), cfg, lmap.remap)
        cfg.fibers = stats["fibers"]

        if opt.check_coverage and init_value is None:
            other, _ = runner.launch(lib, ins, outputs(0x00 if opt.poison else 0xFF), cfg,
                                     lmap.remap)
            self._compare(outs, other, output_dtypes,
                          "{n} element(s) of output '{o}' were never written (or were read before "
                          "being written); first at flat index {i}")
        if opt.check_races:
            for sched, shuffle_groups in (("reverse", False), ("shuffle", True)):
                c = replace(cfg, schedule=sched, shuffle_groups=shuffle_groups,
                            workers=1 if shuffle_groups else cfg.workers, seed=opt.seed + 1)
                other, _ = runner.launch(lib, ins, outputs(), c, lmap.remap)
                self._compare(outs, other, output_dtypes,
                              "race: output '{o}' differs between the forward and " + sched +
                              " schedules at {n} element(s); first at flat index {i}")
        self.last_stats = stats
        return [runner.to_mx(b.buffer.payload(), s, d)
                for b, s, d in zip(outs, output_shapes, output_dtypes)]

    def _compare(self, a, b, dtypes, message):
        for name, x, y, d in zip(self.spec.output_names, a, b, dtypes):
            n, i = runner.first_difference(x.buffer.payload(), y.buffer.payload(),
                                           runner.np_dtype(d).itemsize)
            if n:
                raise KernelRuntimeError("metal_sim: " + message.format(n=n, o=name, i=i))


def metal_kernel(name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                 atomic_outputs=False, compile_options=None, *,
                 options: SimOptions | None = None) -> SimKernel:
    """Same signature and checks as ``mx.fast.metal_kernel``; ``options`` is simulator-only."""
    if not output_names:
        raise ValueError("[metal_kernel] Must specify at least one output.")
    for k, v in (compile_options or {}).items():
        if k != "math_mode":
            raise ValueError(f"[metal_kernel] Unknown compile option `{k}`.")
        if v not in ("safe", "relaxed", "fast"):
            raise ValueError(
                "[metal_kernel] Expected math_mode to be 'safe', 'relaxed', or 'fast'.")
    spec = generator.KernelSpec(name, tuple(input_names), tuple(output_names), source, header,
                                bool(ensure_row_contiguous), bool(atomic_outputs))
    return SimKernel(spec, options or _DEFAULT)
