"""Saving, loading and copying whole-model caches (prompt caches).

A file is one safetensors with every layer's packed state and a metadata block naming what the
cache depends on: the text config, the weights, the load-time overrides and the prefill mode
(and, for a rank's share across ranks, its rank and the group's split), each fingerprinted
separately so that a refusal can name the part that differs, and a sha256 of each array's bytes
so that a damaged file is refused rather than loaded. mlx-lm's
`save_prompt_cache`/`load_prompt_cache` cannot be used as is: its loader only rebuilds its own
cache classes. Its `can_trim_prompt_cache`/`trim_prompt_cache` work on our caches
(`is_trimmable`/`trim`), but `trim_cache` here is atomic across layers.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .layer import CacheError, LayerCache, refresh_trim_budget, unshare_cache

FORMAT_FAMILY = "mlx_v41.prompt_cache."
FORMAT = FORMAT_FAMILY + "v2"  # v2: weights and prefill-mode fingerprints (v1: config only)
SAMPLE = 64  # leading elements hashed per parameter of a model built without a folder
CHECKSUMS = "sha256"  # metadata key: {array name: sha256 of its bytes}, checked on load


def config_fingerprint(model) -> str:
    """sha256 of the text config: caches are only valid for the model that made them."""
    text = json.dumps(model.args.to_dict()["text_config"], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def weights_fingerprint(model) -> str:
    """The fingerprint `load_model` took of the checkpoint files, else that of the parameters
    (a model built in memory)."""
    return getattr(model, "weights_fingerprint", None) or _parameter_fingerprint(model)


def _parameter_fingerprint(model) -> str:
    """sha256 of each parameter's name, dtype, shape and first `SAMPLE` elements."""
    params = sorted(tree_flatten(model.parameters()), key=lambda item: item[0])
    heads = [p.reshape(-1)[:SAMPLE].astype(mx.float32) for _, p in params]
    mx.eval(heads)
    digest = hashlib.sha256()
    for (name, p), head in zip(params, heads):
        digest.update(f"{name}:{p.dtype}:{p.shape}".encode())
        digest.update(np.array(head).tobytes())
    return digest.hexdigest()


def fingerprints(model, share: Optional[dict] = None) -> dict:
    """What a cache depends on, as metadata strings: config, weights, load-time overrides of
    the sparse attention (`load_model(overrides=...)`: another top-k selects other rows) and
    prefill mode (an approximate `ced_replay` cache or another CED halo must not feed an exact
    model), and for a rank's share of a group's cache, `share` ({"rank", "size", "split"}) as
    "group"."""
    prefill = {"prefill_mode": model.prefill_mode, "ced_rollback": model.ced_rollback}
    out = {"config": config_fingerprint(model), "weights": weights_fingerprint(model),
           "prefill": json.dumps(prefill, sort_keys=True)}
    overrides = getattr(model, "overrides", None)
    if overrides:  # absent when none: a model without overrides keeps its earlier identity
        out["overrides"] = json.dumps(dict(overrides), sort_keys=True)
    if share is not None:
        out["group"] = json.dumps(share, sort_keys=True)
    return out


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
    """Write `cache` to `path` (any file name) atomically, with optional string metadata."""
    commit_staged(stage_prompt_cache(path, cache, model, metadata), path)


def commit_staged(staged: Path, path) -> None:
    """Rename a staged file to `path` (a failure leaves the old file and no staged one)."""
    try:
        os.replace(staged, path)
    except BaseException:
        staged.unlink(missing_ok=True)
        raise


def stage_prompt_cache(path, cache: list, model, metadata: Optional[dict] = None,
                       share: Optional[dict] = None) -> Path:
    """Write what `save_prompt_cache` would to a new hidden sibling of `path`, returned for
    the caller to rename to `path` (or delete): a failed write leaves nothing behind.
    `share`: which rank's share of a group's cache this is (`fingerprints`)."""
    arrays, layers = {}, []
    for i, c in enumerate(cache):
        a, meta = _layer_state(i, c)
        arrays.update(a)
        layers.append(meta)
    info = {"format": FORMAT, **fingerprints(model, share), "layers": json.dumps(layers),
            "user": json.dumps(metadata or {}), CHECKSUMS: json.dumps(checksums(arrays))}
    # MLX appends `.safetensors` to any other name, so the sibling carries it.
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp.safetensors")
    try:
        mx.save_safetensors(str(tmp), arrays, metadata=info)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def load_prompt_cache(path, model, return_metadata: bool = False,
                      share: Optional[dict] = None):
    """A new cache list from `path`; refuses a file from another config, other weights or
    another prefill mode, or (`share`, as `stage_prompt_cache`'s) another rank's place."""
    path = Path(path)
    arrays, info = _read(path)
    _check_origin(path, info, model, share)
    _check_data(path, info, arrays)
    layers = json.loads(info["layers"])
    cache = model.make_cache()
    if len(layers) != len(cache):
        stages = model.cfg.num_nextn_predict_layers
        drafter = " (the DSpark rings: load the model with the same dspark setting as the one " \
            "that saved it)" if abs(len(layers) - len(cache)) == stages else ""
        raise CacheError(f"{path}: {len(layers)} layers, the model has {len(cache)}{drafter}")
    for i, (c, meta) in enumerate(zip(cache, layers)):
        _restore(i, c, meta, arrays, path)
    _check_loaded(cache, path)
    user = json.loads(info.get("user", "{}"))
    return (cache, user) if return_metadata else cache


def _read(path: Path) -> tuple[dict, dict]:
    try:  # the format given: MLX would pick it from the extension, which may be anything
        return mx.load(str(path), format="safetensors", return_metadata=True)
    except Exception as e:  # MLX raises RuntimeError/ValueError with its own wording
        raise CacheError(f"{path}: not a readable prompt-cache file ({e})") from None


def _check_origin(path: Path, info: dict, model, share: Optional[dict]) -> None:
    found = info.get("format", "")
    if found != FORMAT and found.startswith(FORMAT_FAMILY):
        raise CacheError(f"{path}: prompt-cache format {found[len(FORMAT_FAMILY):]} from another "
                         f"mlx_v41 version (this one reads {FORMAT[len(FORMAT_FAMILY):]}); "
                         "make the cache again")
    if found != FORMAT:
        raise CacheError(f"{path}: not an mlx_v41 prompt cache")
    expected = fingerprints(model, share)
    if info.get("overrides") != expected.get("overrides"):
        raise CacheError(f"{path}: the cache was made with other sparse-attention overrides "
                         f"({_settings_text(info.get('overrides'), 'none')}; this model: "
                         f"{_settings_text(expected.get('overrides'), 'none')})")
    if info.get("config") != expected["config"]:
        raise CacheError(f"{path}: the cache was made by a model with another config")
    if info.get("weights") != expected["weights"]:
        raise CacheError(f"{path}: the cache was made with other weights (another checkpoint, "
                         "conversion or quantization)")
    if info.get("prefill") != expected["prefill"]:
        raise CacheError(f"{path}: the cache was made with another prefill mode "
                         f"({_settings_text(info.get('prefill'))}; this model: "
                         f"{_settings_text(expected['prefill'])})")
    if info.get("group") != expected.get("group"):
        raise CacheError(f"{path}: the cache was made by {_group_text(info.get('group'))}; "
                         f"this is {_group_text(expected.get('group'))}")


def checksums(arrays: dict) -> dict:
    """sha256 of each array's bytes (row-major, as safetensors stores them), by name."""
    mx.eval(list(arrays.values()))
    return {name: hashlib.sha256(np.array(a.view(mx.uint8))).hexdigest()
            for name, a in sorted(arrays.items())}


def _check_data(path: Path, info: dict, arrays: dict) -> None:
    """Refuse a file whose tensor bytes differ from the checksums saved with them (a file
    written before checksums were stored has none and is not checked)."""
    if CHECKSUMS not in info:
        return
    expected, found = json.loads(info[CHECKSUMS]), checksums(arrays)
    bad = sorted(set(expected) ^ set(found)) or \
        [name for name in sorted(expected) if expected[name] != found[name]]
    if bad:
        raise CacheError(f"{path}: the file is damaged (array {bad[0]!r} does not match its "
                         "checksum); delete it and make the cache again")


def _group_text(group: Optional[str]) -> str:
    if group is None:
        return "one process"
    g = json.loads(group)
    split = g["split"] if isinstance(g["split"], str) else \
        "pipeline " + ", ".join(f"{a}-{b - 1}" for a, b in g["split"])
    return f"rank {g['rank']} of {g['size']} ({split})"


def _settings_text(settings: Optional[str], empty: str = "unknown") -> str:
    settings = json.loads(settings or "{}")
    return ", ".join(f"{k}={v!r}" for k, v in sorted(settings.items())) or empty


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
    """An independent copy sharing the (immutable) MLX arrays: cheap snapshots for chat. Rings
    and rows that are rows of a batch's arrays are copied out, so the copy keeps only its own."""
    copied = [_copy_layer(c) for c in cache]
    unshare_cache(copied)
    return copied


def _copy_layer(c: LayerCache) -> LayerCache:
    new = copy.copy(c)
    new.window = copy.copy(c.window)
    if c.compressed is not None:
        new.compressed = copy.copy(c.compressed)
    return new


def _check_loaded(cache: list, path: Path) -> None:
    """A loaded cache holds one position in every layer, each record agreeing with it; its
    rollback budget is recomputed (it is not stored)."""
    offsets = {c.offset for c in cache}
    if len(offsets) != 1:
        raise CacheError(f"{path}: the layers hold different positions {sorted(offsets)}")
    refresh_trim_budget(cache)
    for i, c in enumerate(cache):
        try:
            c.check(i)
        except CacheError as e:
            raise CacheError(f"{path}: {e}") from None

