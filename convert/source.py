"""The converter's input: a published checkpoint folder (local, or fetched from the Hugging Face
Hub), its shard headers checked against the index and the loader's tables, and readers that
stream tensors out of the shards without keeping them mapped.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Iterator, Optional

import mlx.core as mx
import numpy as np

from mlx_v41.model.config import ModelArgs
from mlx_v41.model.model import Model
from mlx_v41.checkpoint.loader import DROPS, _Shards, data_start, plan, read_index
from mlx_v41.checkpoint.safetensors_io import STORAGE, CheckpointError, SafetensorsFile

INDEX = "model.safetensors.index.json"
# Small files copied to the output when present (the tokenizer and its settings).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja", "engram_token_map.json")
HUB_METADATA = ["config.json", INDEX, "LICENSE", *TOKENIZER_FILES]
READ_BLOCK = 64 * 1024 * 1024  # bytes per read when copying large tensors
MX_DTYPES = {np.uint8: mx.uint8, np.uint16: mx.bfloat16, np.float16: mx.float16,
             np.float32: mx.float32, np.float64: mx.float64, np.int64: mx.int64,
             np.int32: mx.int32, np.int16: mx.int16, np.bool_: mx.bool_}


class ConvertError(ValueError):
    """Bad converter input or settings; the message is one line that names the problem."""


def drop_group(name: str) -> Optional[str]:
    """The loader's drop group of a published tensor ("dspark", "vision"), or None."""
    return next((group for p, _, group in DROPS if re.fullmatch(p, name)), None)


# ---------------------------------------------------------------- locating the input

def resolve(hf_path: str, revision: Optional[str], keep_groups: set) -> Path:
    """A local folder as is; otherwise a Hub repo id fetched with snapshot_download (only the
    metadata, tokenizer and the shards holding tensors we keep; honours HF_HUB_OFFLINE)."""
    local = Path(hf_path).expanduser()
    if local.exists():
        if not local.is_dir():
            raise ConvertError(f"{local}: not a folder")
        return local
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", hf_path):
        raise ConvertError(f"{hf_path}: no such folder, and not a Hugging Face repo id")
    from huggingface_hub import snapshot_download

    try:
        meta = Path(snapshot_download(hf_path, revision=revision, allow_patterns=HUB_METADATA))
        weight_map = json.loads((meta / INDEX).read_text())["weight_map"]
        shards = sorted({shard for name, shard in weight_map.items()
                         if drop_group(name) is None or drop_group(name) in keep_groups})
        return Path(snapshot_download(hf_path, revision=revision,
                                      allow_patterns=HUB_METADATA + shards))
    except (OSError, ValueError, KeyError) as e:  # hub errors subclass these
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConvertError(f"{hf_path}: cannot fetch from the Hugging Face Hub ({first})") \
            from None


# ---------------------------------------------------------------- the checked input

class Source:
    """A published folder: config, index, the loader's plan, and the headers of every shard
    that holds a tensor we keep, all checked before anything is written."""

    def __init__(self, folder: Path, keep_groups: set):
        self.folder = Path(folder)
        if not (self.folder / "config.json").is_file():
            raise CheckpointError(f"{self.folder}: no config.json (not a model folder)")
        self.args = ModelArgs.from_file(self.folder / "config.json")
        self.config = json.loads((self.folder / "config.json").read_text())
        self.index = read_index(self.folder)
        # The drafter is converted like the backbone when kept and present (else left out).
        self.has_dspark = "dspark" in keep_groups and any(
            drop_group(n) == "dspark" for n in self.index)
        self.used, dropped = plan(self.index, dspark=self.has_dspark)
        self.extras = {n: drop_group(n) for n in dropped if drop_group(n) in keep_groups}
        self.dropped = {n: why if drop_group(n) is None else f"{why}; left out by "
                        f"--drop-{drop_group(n)}"
                        for n, why in dropped.items() if n not in self.extras}
        needed = {p for n, p in self.index.items() if n not in self.dropped}
        self.files = {p: SafetensorsFile(p) for p in sorted(needed)}
        self._order = {p: i for i, p in enumerate(sorted(set(self.index.values())))}
        self._check_index()

    def _check_index(self) -> None:
        for name, path in sorted(self.index.items()):
            if path in self.files and name not in self.files[path].entries:
                raise CheckpointError(f"{path}: tensor {name} named in the index is absent")
        for path, f in self.files.items():
            for name in f.entries:
                if self.index.get(name) != path:
                    raise CheckpointError(f"{path}: tensor {name} is not in the index "
                                          f"(or the index places it in another shard)")
        total = self._index_total()
        if total is not None and len(self.files) == len(set(self.index.values())):
            payload = sum(self.nbytes(n) for n in self.index)
            if payload != total:
                raise CheckpointError(f"{self.folder / INDEX}: metadata.total_size {total} "
                                      f"does not match the shards' {payload} payload bytes")

    def _index_total(self) -> Optional[int]:
        path = self.folder / INDEX
        if not path.is_file():
            return None
        total = (json.loads(path.read_text()).get("metadata") or {}).get("total_size")
        return int(total) if isinstance(total, (int, float, str)) and str(total).isdigit() \
            else None

    def skeleton(self) -> Model:
        """The model this input fills (lazy: no parameter is allocated)."""
        return Model(self.args, dspark=self.has_dspark)

    def file(self, name: str) -> SafetensorsFile:
        return self.files[self.index[name]]

    def nbytes(self, name: str) -> int:
        begin, end = self.file(name).entries[name]["data_offsets"]
        return end - begin

    def shard_order(self, name: str) -> int:
        """Position of a tensor's shard, so work runs through the input shard by shard."""
        return self._order[self.index[name]]

    def fingerprint(self) -> str:
        """Hash of what the output depends on: config, tokenizer, every kept tensor's header."""
        h = hashlib.sha256()
        for name in ("config.json", "tokenizer.json", "engram_token_map.json"):
            path = self.folder / name
            h.update(name.encode() + (path.read_bytes() if path.is_file() else b"-"))
        for path, f in self.files.items():
            h.update(json.dumps([path.name, f.path.stat().st_size, f.entries],
                                sort_keys=True).encode())
        return h.hexdigest()

    def tokenizer_files(self) -> list:
        return [self.folder / n for n in TOKENIZER_FILES if (self.folder / n).is_file()]


# ---------------------------------------------------------------- readers

class HeaderShards(_Shards):
    """The loader's shard access over headers only: tensors come back as lazy zeros of the
    stored shape, so the loader's conversion checks run without reading any data."""

    checks_values = False

    def __init__(self, source: Source):
        super().__init__(source.index)
        self.files = dict(source.files)

    def read(self, f: SafetensorsFile, name: str) -> mx.array:
        return mx.zeros(f.shape(name), MX_DTYPES[STORAGE[f.dtype(name)][0]])


class StreamShards(HeaderShards):
    """The loader's shard access with explicit reads: nothing stays memory-mapped, so the
    resident memory is what the current tensor needs."""

    checks_values = True

    def read(self, f: SafetensorsFile, name: str) -> mx.array:
        value = mx.array(read_tensor(f, name))
        return value.view(mx.bfloat16) if f.dtype(name) == "BF16" else value


def read_tensor(f: SafetensorsFile, name: str, rows: Optional[tuple] = None) -> np.ndarray:
    """A tensor (or its rows [a, b)) read from disk into a new numpy array (raw storage)."""
    entry = f.entries[name]
    dtype, size = STORAGE[entry["dtype"]]
    shape = list(entry["shape"])
    row_bytes = size * int(np.prod(shape[1:], dtype=np.int64)) if shape else size
    first, last = rows if rows is not None else (0, shape[0] if shape else 1)
    offset = data_start(f.path) + entry["data_offsets"][0] + first * row_bytes
    count = (last - first) * row_bytes // size
    data = np.fromfile(f.path, dtype=dtype, count=count, offset=offset)
    if data.size != count:
        raise CheckpointError(f"{f.path}: truncated (tensor {name} ends past the file)")
    return data.reshape([last - first, *shape[1:]] if shape else [])


class RowReader:
    """Reads rows of a 2-D tensor into caller buffers (unbuffered; no memory map kept)."""

    def __init__(self, f: SafetensorsFile, name: str):
        self.f, self.name = f, name
        self.start = data_start(f.path) + f.entries[name]["data_offsets"][0]
        shape = f.shape(name)
        self.row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * STORAGE[f.dtype(name)][1]

    def __enter__(self):
        self.handle = open(self.f.path, "rb", buffering=0)
        return self

    def __exit__(self, *exc):
        self.handle.close()

    def __call__(self, first: int, out: np.ndarray) -> None:
        view = memoryview(out).cast("B")
        self.handle.seek(self.start + first * self.row_bytes)
        done = 0
        while done < len(view):
            n = self.handle.readinto(view[done:])
            if not n:
                raise CheckpointError(f"{self.f.path}: truncated (tensor {self.name} ends "
                                      "past the file)")
            done += n


def read_blocks(f: SafetensorsFile, name: str) -> Iterator[memoryview]:
    """The raw bytes of a tensor, in blocks of at most READ_BLOCK."""
    begin, end = f.entries[name]["data_offsets"]
    start = data_start(f.path)
    with open(f.path, "rb") as handle:
        handle.seek(start + begin)
        remaining = end - begin
        while remaining:
            block = handle.read(min(READ_BLOCK, remaining))
            if not block:
                raise CheckpointError(f"{f.path}: truncated (tensor {name} ends past the file)")
            remaining -= len(block)
            yield memoryview(block)
