"""Shared fixtures: the reference goldens copied into tests/data/goldens (see its README)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

DATA = Path(__file__).parent / "data"
GOLDENS = DATA / "goldens"


def golden_checkpoint(name: str) -> Path:
    """`grow` runs the `tiny` weights, so it has no checkpoint copy of its own."""
    return GOLDENS / ("tiny" if name == "grow" else name) / "hf"


def writable_copy(source: Path, folder: Path) -> Path:
    """A writable copy of a checkpoint folder (copyfile: the golden files are read-only)."""
    shutil.copytree(source, folder, copy_function=shutil.copyfile)
    folder.chmod(0o755)
    return folder


def with_context(folder: Path, positions: int) -> Path:
    """Set `max_position_embeddings` of a writable checkpoint copy."""
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = positions
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture
def ckpt(tmp_path) -> Path:
    """A writable copy of the tiny golden checkpoint."""
    return writable_copy(golden_checkpoint("tiny"), tmp_path / "hf")


class Golden:
    def __init__(self, name: str):
        self.name = name
        self.root = GOLDENS / name
        self.hf = golden_checkpoint(name)
        self.prompt = mx.load(str(self.root / "prefill/inputs.safetensors"))["prompt_ids"]
        self.prefill = mx.load(str(self.root / "prefill/outputs.safetensors"))
        self.reference = mx.load(str(self.root / "reference.safetensors"))

    def decode(self, mode: str, key: str) -> mx.array:
        return self.reference[f"decode_{mode}.{key}"]

    def step(self, mode: str, step: int, key: str) -> mx.array:
        return self.reference[f"decode_{mode}.{step:03d}.{key}"]


@pytest.fixture(scope="session")
def goldens():
    cache = {}

    def get(name: str) -> Golden:
        if name not in cache:
            cache[name] = Golden(name)
        return cache[name]

    return get
