"""The vision golden's checkpoint and data (tests/data/vision, see its README).

Its text weights are the `tiny` golden's, so the checkpoint is the tiny folder with the four
files that differ (config, index, the vision shard and the embedding shard) laid over it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx

from conftest import DATA, golden_checkpoint, writable_copy

VISION = DATA / "vision"
IMAGES = [VISION / "images" / "image_0.png", VISION / "images" / "image_1.png"]


def vision_checkpoint(folder: Path) -> Path:
    """A writable copy of the vision golden's checkpoint at `folder`."""
    writable_copy(golden_checkpoint("tiny"), folder)
    for f in (VISION / "hf").iterdir():
        shutil.copyfile(f, folder / f.name)
    return folder


def manifest() -> dict:
    return json.loads((VISION / "manifest.json").read_text())


def reference() -> dict:
    return mx.load(str(VISION / "reference.safetensors"))


def prompt_before_expansion() -> list:
    return manifest()["vision"]["prompt_ids_before_expansion"]
