"""Saving, loading and copying whole-model caches (prompt caches).

A file is one safetensors with every layer's packed state and a metadata block naming the
model config's fingerprint, so a cache from another model or config is refused. mlx-lm's
`save_prompt_cache`/`load_prompt_cache` cannot be used as is: its loader only rebuilds its own
cache classes. Its `can_trim_prompt_cache`/`trim_prompt_cache` work on our caches
(`is_trimmable`/`trim`), but `trim_cache` here is atomic across layers.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

from .layer import CacheError, LayerCache

FORMAT = "mlx_v41.prompt_cache.v1"


def config_fingerprint(model) -> str:
    """sha256 of the text config: caches are only valid for the model that made them."""
    text = json.dumps(model.args.to_dict()["text_config"], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _layer_state(i: int, c: LayerCache) -> tuple[dict, dict]:
    arrays, meta = {}, {"offset": c.offset, "valid_from": c.window.valid_from,
                        "end": c.window.end}
    if c.window.rows is not None:
        arrays[f"{i}.window"] = c.window.rows
    if c.compressed is not None:
        kv = c.compressed
        meta["count"] = kv.count
        if kv.kv is not None:
            arrays[f"{i}.kv"] = kv.kv[:, :kv.count]
            arrays[f"{i}.index_k"] = kv.index_k[:, :kv.count]
        if kv.pending is not None:
            arrays[f"{i}.pending_k"], arrays[f"{i}.pending_s"] = kv.pending
        if kv.inputs is not None:
            arrays[f"{i}.inputs"] = kv.inputs
    if c.engram_ids is not None:
        arrays[f"{i}.engram_ids"] = mx.array(c.engram_ids)
    return arrays, meta


def save_prompt_cache(path, cache: list, model, metadata: Optional[dict] = None) -> None:
    """Write `cache` to `path` (.safetensors) atomically, with optional string metadata."""
    arrays, layers = {}, []
    for i, c in enumerate(cache):
        a, meta = _layer_state(i, c)
        arrays.update(a)
        layers.append(meta)
    info = {"format": FORMAT, "fingerprint": config_fingerprint(model),
            "layers": json.dumps(layers), "user": json.dumps(metadata or {})}
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.safetensors")
    mx.save_safetensors(str(tmp), arrays, metadata=info)
    tmp.replace(path)


def load_prompt_cache(path, model, return_metadata: bool = False):
    """A new cache list from `path`; refuses a file from another model or config."""
    path = Path(path)
    try:
        arrays, info = mx.load(str(path), return_metadata=True)
    except Exception as e:  # MLX raises RuntimeError/ValueError with its own wording
        raise CacheError(f"{path}: not a readable prompt-cache file ({e})") from None
    if info.get("format") != FORMAT:
        raise CacheError(f"{path}: not an mlx_v41 prompt cache")
    if info.get("fingerprint") != config_fingerprint(model):
        raise CacheError(f"{path}: the cache was made by a model with another config")
    layers = json.loads(info["layers"])
    cache = model.make_cache()
    if len(layers) != len(cache):
        raise CacheError(f"{path}: {len(layers)} layers, the model has {len(cache)}")
    for i, (c, meta) in enumerate(zip(cache, layers)):
        _restore(i, c, meta, arrays, path)
    user = json.loads(info.get("user", "{}"))
    return (cache, user) if return_metadata else cache


def _restore(i: int, c: LayerCache, meta: dict, arrays: dict, path: Path) -> None:
    c.offset = meta["offset"]
    c.window.valid_from, c.window.end = meta["valid_from"], meta["end"]
    c.window.rows = arrays.get(f"{i}.window")
    if c.window.rows is not None and c.window.rows.shape[1] != c.window.capacity:
        raise CacheError(f"{path}: layer {i} window ring has the wrong capacity")
    if c.compressed is not None:
        kv = c.compressed
        kv.count = meta["count"]
        kv.kv, kv.index_k = arrays.get(f"{i}.kv"), arrays.get(f"{i}.index_k")
        if kv.count and (kv.kv is None or kv.kv.shape[1] != kv.count):
            raise CacheError(f"{path}: layer {i} compressed rows do not match their count")
        if f"{i}.pending_k" in arrays:
            kv.pending = (arrays[f"{i}.pending_k"], arrays[f"{i}.pending_s"])
        kv.inputs = arrays.get(f"{i}.inputs")
    if c.engram_ids is not None:
        ids = arrays.get(f"{i}.engram_ids")
        c.engram_ids = np.array(ids) if ids is not None else c.engram_ids


def copy_cache(cache: list) -> list:
    """An independent copy sharing the (immutable) MLX arrays: cheap snapshots for chat."""
    return [copy.copy(_copy_layer(c)) for c in cache]


def _copy_layer(c: LayerCache) -> LayerCache:
    new = copy.copy(c)
    new.window = copy.copy(c.window)
    if c.compressed is not None:
        new.compressed = copy.copy(c.compressed)
    return new
