"""The Metal text MLX generates for a custom kernel call.

Two ways to get it (design note, section 2):

* ``capture``: run MLX's own generator. Calling a kernel raises on a machine without Metal,
  except while ``mx.export_function`` is tracing; with ``verbose=True`` MLX then prints the full
  text to C++ ``std::cout`` (file descriptor 1), which we redirect and parse.
* ``port``: a literal Python port of ``write_signature`` / ``write_template`` and the
  kernel-name rules of ``mlx/backend/common/metal_kernel.cpp`` (quirks included).

``tests/test_metal_sim.py`` checks that both give the same bytes on the installed MLX.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import tempfile
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx

MAX_CONSTANT_ARRAY_SIZE = 8  # inputs with fewer elements go to the `constant` address space

# MLX's attribute table, in MLX's order, with MLX's types (metal_kernel.cpp).
ATTRIBUTES = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)
ATTRIBUTE_TYPES = dict(ATTRIBUTES)

_TYPE_STRINGS = {
    mx.bool_: "bool",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.float16: "float16_t",
    mx.bfloat16: "bfloat16_t",
    mx.float32: "float",
    mx.float64: "double",
    mx.complex64: "complex64_t",
}


def type_string(dtype: mx.Dtype) -> str:
    """MLX's ``get_type_string`` (compiled.cpp)."""
    return _TYPE_STRINGS[dtype]


@dataclass(frozen=True)
class KernelSpec:
    """What ``metal_kernel(...)`` was given."""

    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    source: str
    header: str
    ensure_row_contiguous: bool
    atomic_outputs: bool

    def shape_infos(self) -> list[tuple[bool, bool, bool]]:
        """Which of ``<name>_shape/_strides/_ndim`` the *source* mentions (substring search)."""
        return [(f"{n}_shape" in self.source, f"{n}_strides" in self.source,
                 f"{n}_ndim" in self.source)
                for n in self.input_names]

    def attributes(self) -> list[str]:
        return [a for a, _ in ATTRIBUTES if a in self.source]


@dataclass(frozen=True)
class InputMeta:
    """All the generated text depends on for one input: dtype and size class."""

    dtype: mx.Dtype
    ndim: int
    size: int

    @property
    def size_class(self) -> str:
        if self.ndim == 0:
            return "scalar"
        return "small" if self.size < MAX_CONSTANT_ARRAY_SIZE else "regular"


def check_template(template) -> list[tuple[str, object]]:
    """MLX's template-argument typing: ``bool`` is tested before ``int``."""
    out = []
    for item in template or []:
        name, value = item
        if not isinstance(value, (bool, int, mx.Dtype)):
            raise ValueError(
                "[metal_kernel] Invalid template argument. Must be `mlx.core.Dtype`, `int` or "
                "`bool`.")
        out.append((name, value))
    return out


def _template_value(v) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    return type_string(v)


def write_template(template) -> str:
    return "<" + ", ".join(_template_value(v) for _, v in template) + ">"


def kernel_name(spec: KernelSpec, metas, output_dtypes, template) -> str:
    name = "custom_kernel_" + spec.name
    if template:
        # `<`, `>` and `, ` become `_` (metal_kernel.cpp); the 0.32.4 wheel also maps the `-` of
        # negative ints (observed; the agreement test pins it).
        h = re.sub(r"<|>|(, )|-", "_", write_template(template))
        name += "_" + h[:-1]
    for m in metas:
        name += "_" + type_string(m.dtype)
        if m.ndim == 0:
            name += "s"
        elif m.size < MAX_CONSTANT_ARRAY_SIZE:
            name += "c"
    for d in output_dtypes:
        name += "_" + type_string(d)
    return name


def port_source(spec: KernelSpec, metas, output_dtypes, template) -> str:
    """Python port of MLX's ``write_signature`` + explicit instantiation, byte for byte."""
    kname = kernel_name(spec, metas, output_dtypes, template)
    shape_infos = spec.shape_infos()
    attributes = [f"  {ATTRIBUTE_TYPES[a]} {a} [[{a}]]" for a in spec.attributes()]
    s = spec.header
    if template:
        kinds = []
        for n, v in template:
            kind = "bool" if isinstance(v, bool) else "int" if isinstance(v, int) else "typename"
            kinds.append(f"{kind} {n}")
        s += "template <" + ", ".join(kinds) + ">\n"
    s += f"[[kernel]] void {kname}(\n"
    index = 0
    for name, m, (has_shape, has_strides, has_ndim) in zip(spec.input_names, metas, shape_infos):
        location = "constant" if m.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if m.ndim == 0 else "*"
        s += f"  const {location} {type_string(m.dtype)}{ref} {name} [[buffer({index})]],\n"
        index += 1
        if m.ndim > 0:
            if has_shape:
                s += f"  const constant int* {name}_shape [[buffer({index})]],\n"
                index += 1
            if has_strides:
                s += f"  const constant int64_t* {name}_strides [[buffer({index})]],\n"
                index += 1
            if has_ndim:
                s += f"  const constant int& {name}_ndim [[buffer({index})]],\n"
                index += 1
    n_in, n_out = len(metas), len(spec.output_names)
    for name, dtype in zip(spec.output_names, output_dtypes):
        t = type_string(dtype)
        if spec.atomic_outputs:
            t = f"atomic<{t}>"
        s += f"  device {t}* {name} [[buffer({index})]]"
        # MLX compares the *buffer* index (which counts shape/strides/ndim buffers) with
        # #inputs + #outputs - 1: reproduced verbatim, quirk included.
        s += ",\n" if (index < n_in + n_out - 1 or attributes) else ") {\n"
        index += 1
    for i, attr in enumerate(attributes):
        s += attr + (",\n" if i < len(attributes) - 1 else ") {\n")
    s += spec.source + "\n}\n"
    if template:
        inst = kname + write_template(template)
        s += f'\ntemplate [[host_name("{kname}")]] [[kernel]] decltype({inst}) {inst};\n'
    return s


# ------------------------------------------------------------------------------ capture
_CAPTURE_RE = re.compile(r"Generated source code for `[^`]*`:\n```\n(.*)\n```\n", re.S)
_mlx_kernels: dict = {}


@contextmanager
def _stdout_fd_to_file():
    """Redirect file descriptor 1 (C++ std::cout) to a temporary file; yields a reader."""
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 1)
        text: list[str] = []
        try:
            yield text
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
            f.seek(0)
            text.append(f.read().decode("utf-8"))


def _example(m: InputMeta) -> mx.array:
    if m.ndim == 0:
        shape = ()
    else:
        shape = (1,) if m.size < MAX_CONSTANT_ARRAY_SIZE else (MAX_CONSTANT_ARRAY_SIZE,)
    return mx.zeros(shape, dtype=m.dtype)


def capture_source(spec: KernelSpec, metas, output_dtypes, template) -> str:
    """MLX's own text, obtained by tracing a call under ``mx.export_function``."""
    k = _mlx_kernels.get(spec)
    if k is None:
        k = mx.fast.metal_kernel(
            name=spec.name, input_names=list(spec.input_names),
            output_names=list(spec.output_names), source=spec.source, header=spec.header,
            ensure_row_contiguous=spec.ensure_row_contiguous, atomic_outputs=spec.atomic_outputs)
        _mlx_kernels[spec] = k
    n_out = len(spec.output_names)

    def f(*xs):
        return k(inputs=list(xs), template=list(template) or None, grid=(1, 1, 1),
                 threadgroup=(1, 1, 1), output_shapes=[(1,)] * n_out,
                 output_dtypes=list(output_dtypes), verbose=True)

    with tempfile.TemporaryDirectory() as d:
        with _stdout_fd_to_file() as out:
            mx.export_function(os.path.join(d, "k.mlxfn"), f, *[_example(m) for m in metas])
    m = _CAPTURE_RE.search(out[0])
    if m is None:
        raise RuntimeError("metal_sim: MLX printed no generated source under export tracing")
    return m.group(1)


# ------------------------------------------------------------------------------ memoised entry
_memo: dict = {}
_warned = False


def _memo_key(spec, metas, output_dtypes, template, mode):
    h = hashlib.sha256((spec.source + "\0" + spec.header).encode()).hexdigest()
    return (mode, spec.name, h, spec.input_names, spec.output_names, spec.atomic_outputs,
            tuple((m.dtype, m.size_class) for m in metas), tuple(output_dtypes),
            tuple((n, type(v).__name__, str(v)) for n, v in template))


def generate(spec: KernelSpec, metas, output_dtypes, template, mode: str = "auto") -> str:
    """The Metal text for this call. ``mode``: ``auto`` (capture, else port), ``mlx``, ``port``."""
    global _warned
    if mode not in ("auto", "mlx", "port"):
        raise ValueError(f"metal_sim: unknown source mode {mode!r}")
    key = _memo_key(spec, metas, output_dtypes, template, mode)
    text = _memo.get(key)
    if text is not None:
        return text
    if mode == "port":
        text = port_source(spec, metas, output_dtypes, template)
    elif mode == "mlx":
        text = capture_source(spec, metas, output_dtypes, template)
    else:
        try:
            text = capture_source(spec, metas, output_dtypes, template)
        except RuntimeError as e:
            # Only a closed capture path falls back to the port; MLX's own argument errors
            # propagate.
            if "No Metal back-end" not in str(e) and "no generated source" not in str(e):
                raise
            if not _warned:
                warnings.warn(f"metal_sim: capturing MLX's source failed ({e}); using the port")
                _warned = True
            text = port_source(spec, metas, output_dtypes, template)
    _memo[key] = text
    return text
