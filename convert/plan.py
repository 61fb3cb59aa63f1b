"""The conversion plan: every output file and tensor, with its dtype, shape and bytes, fixed
before anything is written, so interrupted runs can match finished files by name and size.

Output streams (one folder each):
* `model-*.safetensors`: the text model's parameters under our module names, in the recipe's
  layout; work runs target by target (one module's weight + scales, or one plain tensor).
* `dspark-*.safetensors`: the DSpark drafter's parameters (`dspark.*`), converted exactly like
  the backbone's (same recipe), in files of their own that a load without the drafter skips.
* `engram/<module>-*.safetensors`: each Engram table as packed rows (see ENGRAM_ROWS), split by
  row ranges into files of the shard size; memory-mapped at load.
* `extras/<group>-*.safetensors`: the vision tower, byte for byte under its published names and
  dtypes (BF16) in every recipe (unless dropped); the converted loader reads it from there.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Iterator, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlx_v41.model.layers import configure_quantization, is_quantized
from mlx_v41.checkpoint.loader import check_table, convert_target, engram_tables, missing_error
from mlx_v41.checkpoint.safetensors_io import STORAGE, CheckpointError

from .recipes import DTYPES, Recipe, requantize
from .source import HeaderShards, RowReader, Source, StreamShards, read_blocks

FORMAT = "mlx_v41.convert/2"  # 2: the drafter in dspark-* files (1: verbatim in extras/)
# Packed Engram rows, row r of a file = table row first_row + r, head_dim + head_dim/32 bytes:
# head_dim E4M3 codes, then one E8M0 scale per 32 codes. One row is one contiguous span, so a
# lookup touches one page (two when the row straddles a page boundary).
ENGRAM_ROWS = "rows"
ROW_GROUP = 32
ROWS_PER_READ = 1 << 18  # table rows copied per read (~70 MB at the real head_dim)
E8M0_NAN = 255
DSPARK = "dspark."  # module path of the drafter's parameters
DTYPE_BYTES = {**{name: size for name, (_, size) in STORAGE.items()}, "U32": 4}
SAFETENSORS_DTYPES = {mx.bfloat16: "BF16", mx.float16: "F16", mx.float32: "F32",
                      mx.uint32: "U32", mx.uint8: "U8", mx.int32: "I32"}


@dataclass
class Tensor:
    name: str
    dtype: str      # safetensors dtype name
    shape: tuple

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * DTYPE_BYTES[self.dtype]


class Item:
    """A unit of work: consecutive tensors of one output file, produced as byte blocks."""

    tensors: list
    order: tuple = ()

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def produce(self, source: Source) -> Iterator[tuple]:
        """Yields (tensor name, bytes-like block) in `tensors` order."""
        raise NotImplementedError


@dataclass
class TargetItem(Item):
    """One model target: a plain tensor, or a quantized module's packed parameters."""

    target: str
    entries: list
    params: dict                     # official skeleton parameters (for the loader's checks)
    tensors: list
    requant: Optional[tuple] = None  # (official layout, recipe layout)
    dtype: Optional[str] = None      # cast of a plain BF16 tensor
    order: tuple = ()

    def produce(self, source: Source):
        arrays = convert_target(StreamShards(source), self.target, self.entries, self.params,
                                cast=False)
        if self.requant is not None:
            parts = {k.rsplit(".", 1)[1]: v for k, v in arrays.items()}
            names = [t.name for t in self.tensors]
            arrays = dict(zip(names, requantize(parts, *self.requant)))
        elif self.dtype is not None and arrays[self.target].dtype == mx.bfloat16:
            arrays = {self.target: arrays[self.target].astype(getattr(mx, self.dtype))}
        for t in self.tensors:
            value = arrays[t.name]
            mx.eval(value)
            got = (SAFETENSORS_DTYPES.get(value.dtype), tuple(value.shape))
            if got != (t.dtype, t.shape):
                raise RuntimeError(f"{t.name}: produced {got}, planned {(t.dtype, t.shape)}")
            yield t.name, as_bytes(value)
        del arrays, value
        mx.clear_cache()  # bound the resident memory by the current target


def as_bytes(value: mx.array) -> memoryview:
    """The bytes of an evaluated array in row-major order (bf16 through its uint16 bits)."""
    raw = np.asarray(value.view(mx.uint16) if value.dtype == mx.bfloat16 else value)
    return memoryview(np.ascontiguousarray(raw)).cast("B")


@dataclass
class TableItem(Item):
    """Rows [first, last) of a published Engram table, packed as ENGRAM_ROWS."""

    base: str
    first: int
    last: int
    head_dim: int
    tensors: list
    order: tuple = ()

    def produce(self, source: Source):
        weight, scale = f"{self.base}.weight", f"{self.base}.scale"
        scale_width = self.head_dim // ROW_GROUP
        rows = min(ROWS_PER_READ, self.last - self.first)
        codes = np.empty((rows, self.head_dim), np.uint8)   # reused: blocks are consumed
        scales = np.empty((rows, scale_width), np.uint8)    # before the next one is read
        packed = np.empty((rows, self.head_dim + scale_width), np.uint8)
        with RowReader(source.file(weight), weight) as read_codes, \
                RowReader(source.file(scale), scale) as read_scales:
            for a in range(self.first, self.last, rows):
                n = min(rows, self.last - a)
                read_codes(a, codes[:n])
                read_scales(a, scales[:n])
                bad = np.flatnonzero((scales[:n] == E8M0_NAN).any(axis=1))
                if bad.size:
                    raise CheckpointError(f"{source.index[scale]}: tensor {scale} holds the "
                                          f"E8M0 NaN byte 255 (row {a + int(bad[0])})")
                packed[:n, :self.head_dim] = codes[:n]
                packed[:n, self.head_dim:] = scales[:n]
                yield ENGRAM_ROWS, memoryview(packed[:n]).cast("B")


@dataclass
class ExtraItem(Item):
    """A published tensor copied byte for byte."""

    name: str
    tensors: list
    order: tuple = ()

    def produce(self, source: Source):
        for block in read_blocks(source.file(self.name), self.name):
            yield self.name, block


@dataclass
class OutFile:
    name: str                            # path relative to the output folder
    items: list
    metadata: dict = field(default_factory=dict)

    @property
    def tensors(self) -> list:
        return [t for item in self.items for t in item.tensors]

    def header(self) -> bytes:
        """safetensors header: 8-byte length, JSON (tensors in file order), space padding."""
        header, offset = {"__metadata__": {"format": "mlx", **self.metadata}}, 0
        for t in self.tensors:
            header[t.name] = {"dtype": t.dtype, "shape": list(t.shape),
                              "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        return len(text).to_bytes(8, "little") + text

    @property
    def size(self) -> int:
        return len(self.header()) + sum(t.nbytes for t in self.tensors)


@dataclass
class Plan:
    files: list                          # OutFile, in the order they are written
    recipe: Recipe
    quantization: dict
    tables: dict                         # module path -> {rows, head_dim, files: [...]}
    fingerprint: str
    dropped: dict                        # published tensor -> reason

    def group(self, prefix: str) -> list:
        return [f for f in self.files if f.name.startswith(prefix)]

    def sizes(self) -> dict:
        sizes = {key: sum(f.size for f in self.group(prefix)) for key, prefix in
                 (("weights", "model-"), ("dspark", "dspark-"), ("engram_tables", "engram/"),
                  ("extras", "extras/"))}
        return {**sizes, "total": sum(sizes.values())}


# ---------------------------------------------------------------- planning

def make_plan(source: Source, recipe: Recipe, shard_size: int) -> Plan:
    """Check every kept tensor against the config (the loader's checks, on headers only) and
    lay out the output files; raises CheckpointError naming the first bad tensor."""
    official = source.skeleton()
    params = dict(tree_flatten(official.parameters()))
    tables = engram_tables(official)
    output = source.skeleton()
    quantized = {path for path, m in output.named_modules() if is_quantized(m)}
    if set(recipe.layouts) != quantized:
        raise ValueError("the recipe was made for another model: build it from "
                         "source.skeleton()")
    configure_quantization(output, recipe.quantization())
    out_params = dict(tree_flatten(output.parameters()))
    header = HeaderShards(source)
    items, table_items, filled = [], {}, set()
    for target, entries in source.used.items():
        kind, base = entries[0][0], entries[0][1]
        if kind == "fp8_rows":
            if target not in tables:
                raise CheckpointError(f"tensor {base} maps to {target}, which this config "
                                      "does not have")
            check_table(header, tables[target], base)
            table_items[target] = _table_items(source, target, base, tables[target], shard_size)
            continue
        arrays = convert_target(header, target, entries, params, cast=False)
        filled.update(arrays)
        items.append(_target_item(source, recipe, target, entries, params, arrays, out_params))
    missing = sorted(set(params) - filled) + sorted(set(tables) - set(table_items))
    if missing:
        raise missing_error(source.folder, missing)
    files = _weight_files(items, shard_size)
    table_files = {}
    for target, chunks in sorted(table_items.items()):
        table_files[target] = _pack(chunks, f"engram/{target}", 0)
        files += table_files[target]
    files += _extras(source, shard_size)
    plan = Plan(files, recipe, recipe.quantization(), _table_manifest(tables, table_files), "",
                source.dropped)
    plan.fingerprint = _fingerprint(source, plan, shard_size)
    return plan


def _target_item(source, recipe, target, entries, params, arrays, out_params) -> TargetItem:
    order = (min(source.shard_order(e[1] if e[0] == "plain" else f"{e[1]}.weight")
                 for e in entries), target)
    if entries[0][0] == "plain":
        (value,) = arrays.values()
        dtype = SAFETENSORS_DTYPES[value.dtype]
        cast = recipe.dtype if dtype == "BF16" and recipe.dtype else None
        tensor = Tensor(target, DTYPES[cast] if cast else dtype, tuple(value.shape))
        return TargetItem(target, entries, params, [tensor], dtype=cast, order=order)
    names = [f"{target}.{p}" for p in ("weight", "scales", "biases")
             if f"{target}.{p}" in out_params]
    tensors = [Tensor(n, SAFETENSORS_DTYPES[out_params[n].dtype], tuple(out_params[n].shape))
               for n in names]
    requant = (recipe.official[target], recipe.layouts[target]) \
        if recipe.is_requantized(target) else None
    return TargetItem(target, entries, params, tensors, requant=requant, order=order)


def _weight_files(items: list, shard_size: int) -> list:
    """The backbone's targets into model-*, the drafter's into dspark-*, in input order."""
    items = sorted(items, key=lambda item: item.order)
    backbone = [item for item in items if not item.target.startswith(DSPARK)]
    drafter = [item for item in items if item.target.startswith(DSPARK)]
    return _pack(backbone, "model", shard_size) + _pack(drafter, "dspark", shard_size)


def _table_items(source, target, base, table, shard_size) -> list:
    width = table.head_dim + table.head_dim // ROW_GROUP
    per_file = max(1, shard_size // width)
    return [TableItem(base, a, min(a + per_file, table.rows), table.head_dim,
                      [Tensor(ENGRAM_ROWS, "U8", (min(a + per_file, table.rows) - a, width))],
                      order=(a,))
            for a in range(0, table.rows, per_file)]


def _extras(source: Source, shard_size: int) -> list:
    files = []
    for group in sorted(set(source.extras.values())):
        names = sorted((n for n, g in source.extras.items() if g == group),
                       key=lambda n: (source.shard_order(n), n))
        items = []
        for name in names:
            f = source.file(name)
            items.append(ExtraItem(name, [Tensor(name, f.dtype(name), f.shape(name))]))
        files += _pack(items, f"extras/{group}", shard_size)
    return files


def _pack(items: list, stem: str, shard_size: int) -> list:
    """Consecutive items into files of at most `shard_size` payload bytes (an item larger
    than that gets a file of its own; 0 = one item per file)."""
    groups, size = [], 0
    for item in items:
        if not groups or shard_size == 0 or size + item.nbytes > shard_size:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += item.nbytes
    n = len(groups)
    return [OutFile(f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups)]


def _table_manifest(tables: dict, table_files: dict) -> dict:
    out = {}
    for target, files in table_files.items():
        for f in files:
            f.metadata = {"first_row": str(f.items[0].first),
                          "head_dim": str(tables[target].head_dim)}
        out[target] = {"rows": tables[target].rows, "head_dim": tables[target].head_dim,
                       "files": [{"file": f.name, "first_row": f.items[0].first,
                                  "rows": f.items[0].last - f.items[0].first} for f in files]}
    return out


def _fingerprint(source: Source, plan: Plan, shard_size: int) -> str:
    h = hashlib.sha256(FORMAT.encode())
    h.update(source.fingerprint().encode())
    h.update(json.dumps([plan.quantization, plan.recipe.describe(), shard_size],
                        sort_keys=True).encode())
    for f in plan.files:
        h.update(f.name.encode() + f.header())
    return h.hexdigest()
