"""Loading a folder written by `mlx_v41.convert`: MLX safetensors shards under our module
names in the layouts of config.json's `quantization` block (mlx-lm's form; the DSpark drafter's
in `dspark-*` files, read only into a model built with it; the vision tower verbatim in
`extras/vision-*`, likewise), Engram tables as packed-row files
memory-mapped in place, and the Engram token map saved at conversion.

The manifest (`mlx_v41_convert.json`) says the folder is complete and lists every file with
its size and sha256; sizes are checked at load (a truncated file is an error), hashes by the
converter when it resumes.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..model.engram import EngramRows
from ..model.layers import configure_quantization
from . import slicing
from .loader import data_start, engram_tables, no_dspark, no_vision
from ..errors import CheckpointError
from .placement import WHOLE, Placement
from .safetensors_io import SafetensorsFile
from .streaming import converted_regions

MANIFEST = "mlx_v41_convert.json"
FORMAT_PREFIX = "mlx_v41.convert/"


def is_converted(folder) -> bool:
    return (Path(folder) / MANIFEST).is_file()


def read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        raise CheckpointError(f"{path}: unreadable conversion manifest") from None
    if not str(manifest.get("format", "")).startswith(FORMAT_PREFIX):
        raise CheckpointError(f"{path}: not a manifest written by mlx_v41.convert")
    if not manifest.get("complete"):
        raise CheckpointError(f"{folder}: the conversion did not finish (re-run "
                              "mlx_v41.convert to complete it)")
    return manifest


def _checked_file(folder: Path, manifest: dict, name: str) -> Path:
    path = folder / name
    expected = manifest["files"].get(name, {}).get("bytes")
    if not path.is_file():
        raise CheckpointError(f"{path}: file listed in the manifest is missing")
    if expected is not None and path.stat().st_size != expected:
        raise CheckpointError(f"{path}: {path.stat().st_size} bytes, the manifest says "
                              f"{expected} (truncated or modified)")
    return path


def _load_weights(model, folder: Path, manifest: dict, placement: Placement,
                  streaming=None) -> None:
    params = dict(tree_flatten(model.parameters()))
    loaded = {}
    modules = {}  # path -> module, for the tensors this process reads a share of
    # Without the drafter its files stay unread: the published load drops mtp.* likewise.
    drafter = manifest.get("dspark", []) if "dspark" in model else []
    # The vision tower is kept verbatim (published names = our parameter names, BF16).
    tower = manifest.get("extras", {}).get("vision", []) if "vision" in model else []
    for name in manifest["weights"] + drafter + tower:
        path = _checked_file(folder, manifest, name)
        header = None
        for key, value in mx.load(str(path)).items():
            switch = key.rpartition(".")[0].rpartition(".")[0]
            if streaming is not None and streaming.owns(switch):  # left in the file
                header = header or SafetensorsFile(path)
                spec = placement.shard(key.rpartition(".")[0])
                converted_regions(streaming, header, path, key, spec.start if spec else 0)
                continue
            if key not in params and placement.is_partial:
                continue  # another rank's tensor (mx.load reads lazily)
            if key not in params:
                raise CheckpointError(f"{path}: tensor {key} is not a parameter of this model")
            value = _share(placement, model, modules, key, value)
            expected = params[key]
            if tuple(value.shape) != tuple(expected.shape):
                raise CheckpointError(f"{path}: tensor {key} has shape {tuple(value.shape)}, "
                                      f"expected {tuple(expected.shape)}")
            is_float = mx.issubdtype(value.dtype, mx.floating)
            if not is_float and value.dtype != expected.dtype:
                raise CheckpointError(f"{path}: tensor {key} has dtype {value.dtype}, "
                                      f"expected {expected.dtype}")
            # Float tensors may be stored in another dtype (--dtype); the model computes in its own.
            loaded[key] = value.astype(expected.dtype) if is_float else value
    missing = sorted(set(params) - set(loaded))
    if missing:
        raise CheckpointError(f"{folder}: no tensor for parameter {missing[0]} "
                              f"({len(missing)} missing)")
    model.update(tree_unflatten(list(loaded.items())))
    mx.eval(model.parameters())


def _share(placement: Placement, model, modules: dict, key: str, value: mx.array) -> mx.array:
    """This process's share of `value` (a copy: the whole tensor is not kept), or `value`."""
    module_path, _, leaf = key.rpartition(".")
    spec = placement.shard(key) or placement.shard(module_path)
    if not spec:
        return value
    if not modules:  # listed once, at the first split tensor
        modules.update(model.named_modules())
    part = value[slicing.converted(spec, leaf, modules[module_path], key)]
    if part.dtype == mx.bfloat16:  # numpy has no bfloat16: copy the bits
        return mx.array(np.array(part.view(mx.uint16))).view(mx.bfloat16)
    return mx.array(np.array(part))


def _attach_tables(model, folder: Path, manifest: dict) -> None:
    described = manifest.get("engram", {}).get("tables", {})
    for target, table in engram_tables(model).items():
        if target not in described:
            raise CheckpointError(f"{folder}: the manifest has no Engram table for {target}")
        files = []
        for part in described[target]["files"]:
            path = _checked_file(folder, manifest, part["file"])
            header = SafetensorsFile(path)
            (name,) = header.keys()
            width = table.head_dim + table.head_dim // 32
            if header.dtype(name) != "U8" or header.shape(name) != (part["rows"], width):
                raise CheckpointError(f"{path}: expected packed rows U8 {[part['rows'], width]}"
                                      f", got {header.dtype(name)} {list(header.shape(name))}")
            offset = data_start(path) + header.entries[name]["data_offsets"][0]
            files.append((path, offset, part["rows"], table.head_dim))
        table.attach(EngramRows.from_packed(files))


def load_converted(model, folder, placement: Placement = WHOLE,
                   experts=None) -> np.ndarray | None:
    """Fill `model` from a converted folder; -> the Engram token map (None without Engram).
    `placement`, `experts`: as `loader.load_weights`'s."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    if "dspark" in model and not manifest.get("dspark"):
        raise no_dspark(folder, "converted without them (--drop-dspark, a source without "
                        "mtp.*, or an mlx_v41.convert before format 2)")
    if "vision" in model and not manifest.get("extras", {}).get("vision"):
        raise no_vision(folder, "converted without it (--drop-vision, or a source without it)")
    quantization = model.args.quantization
    if not isinstance(quantization, dict):
        raise CheckpointError(f"{folder / 'config.json'}: a converted model needs a "
                              "'quantization' block")
    try:
        configure_quantization(model, quantization)
    except ValueError as e:
        raise CheckpointError(f"{folder / 'config.json'}: {e}") from None
    streaming = experts(model) if experts is not None else None
    _load_weights(model, folder, manifest, placement, streaming)
    _attach_tables(model, folder, manifest)
    token_map = manifest.get("engram", {}).get("token_map")
    if token_map is None:
        return None
    return np.load(_checked_file(folder, manifest, token_map))
