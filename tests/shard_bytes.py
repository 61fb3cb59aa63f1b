"""Reading and rewriting safetensors shards at the byte level, for bad-input tests."""

import json
import struct
from pathlib import Path


def read_shard(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_shard(path: Path, header: dict, payload: bytes) -> None:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + payload)
