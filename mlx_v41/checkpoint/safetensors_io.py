"""Memory-mapped safetensors reading with byte-level checks, for every dtype the checkpoint uses.

MLX's own loader does not read F8_E4M3 / F8_E8M0 tensors, and the Engram tables must stay on
disk, so tensors are sliced from a read-only `numpy.memmap` of the file. FP8 and I8 (packed FP4)
payloads come back as uint8 bytes, BF16 as bfloat16.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import CheckpointError

# safetensors dtype -> (numpy storage dtype, bytes per element)
STORAGE = {
    "BF16": (np.uint16, 2), "F16": (np.float16, 2), "F32": (np.float32, 4),
    "F64": (np.float64, 8), "I64": (np.int64, 8), "I32": (np.int32, 4), "I16": (np.int16, 2),
    "U32": (np.uint32, 4),
    "I8": (np.uint8, 1), "U8": (np.uint8, 1), "BOOL": (np.bool_, 1),
    "F8_E4M3": (np.uint8, 1), "F8_E8M0": (np.uint8, 1),
}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the real index headers are < 1 MB per shard


class SafetensorsFile:
    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: shard file not found")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{self.path}: truncated (no safetensors header)")
            (n,) = struct.unpack("<Q", head)
            if n > min(MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(f"{self.path}: truncated or corrupt header")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise CheckpointError(f"{self.path}: corrupt safetensors header") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: corrupt safetensors header (not an object)")
        self.metadata = header.pop("__metadata__", {}) or {}
        self.entries = header
        self._start = 8 + n
        self._size = size
        for name, entry in self.entries.items():
            self._check_entry(name, entry)
        self._map = None

    def _check_entry(self, name, entry):
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
            raise CheckpointError(f"{self.path}: tensor {name} has a malformed header entry")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
                and isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) for o in offsets) and 0 <= offsets[0] <= offsets[1]):
            raise CheckpointError(f"{self.path}: tensor {name} has a malformed shape or offsets")
        if dtype not in STORAGE:
            raise CheckpointError(f"{self.path}: tensor {name} has unsupported dtype {dtype}")
        begin, end = entry["data_offsets"]
        count = int(np.prod(entry["shape"], dtype=np.int64))
        if end - begin != count * STORAGE[dtype][1]:
            raise CheckpointError(f"{self.path}: tensor {name} byte size does not match its "
                                  f"shape {entry['shape']} and dtype {dtype}")
        if self._start + end > self._size:
            raise CheckpointError(f"{self.path}: truncated (tensor {name} ends past the file)")

    def keys(self):
        return list(self.entries)

    @property
    def start(self) -> int:
        """Byte offset of the payload (a tensor's `data_offsets` count from it)."""
        return self._start

    def dtype(self, name) -> str:
        return self.entries[name]["dtype"]

    def shape(self, name) -> tuple:
        return tuple(self.entries[name]["shape"])

    def numpy(self, name) -> np.ndarray:
        """A read-only view into the memory map (no copy)."""
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        entry = self.entries[name]
        begin, end = entry["data_offsets"]
        raw = self._map[self._start + begin:self._start + end]
        return raw.view(STORAGE[entry["dtype"]][0]).reshape(entry["shape"])

    def get(self, name, index=None) -> mx.array:
        """The tensor (or its part `index`, a numpy index) as an MLX array, copied into
        memory: only the part is read and kept."""
        raw = self.numpy(name)
        arr = mx.array(np.ascontiguousarray(raw if index is None else raw[index]))
        if self.dtype(name) == "BF16":
            arr = arr.view(mx.bfloat16)
        return arr
