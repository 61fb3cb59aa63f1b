"""The vision golden's checkpoint and data (tests/data/vision, see its README).

Its text weights are the `tiny` golden's, so the checkpoint is the tiny folder with the four
files that differ (config, index, the vision shard and the embedding shard) laid over it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np
from PIL import Image

from conftest import DATA, golden_checkpoint, writable_copy

VISION = DATA / "vision"
IMAGES = [VISION / "images" / "image_0.png", VISION / "images" / "image_1.png"]
SMALL_MIN_PIXELS = 9 * 14 * 14  # one 3 x 3 cell: images are not scaled up
TWIN_SPAN = 17  # positions of a twin's span: 3 x 4 cells, a newline per row, start and end


def vision_checkpoint(folder: Path, min_pixels: Optional[int] = None) -> Path:
    """A writable copy of the vision golden's checkpoint at `folder` (with
    `vision_config.min_pixels` set, when given)."""
    writable_copy(golden_checkpoint("tiny"), folder)
    for f in (VISION / "hf").iterdir():
        shutil.copyfile(f, folder / f.name)
    if min_pixels is not None:
        config = json.loads((folder / "config.json").read_text())
        config["vision_config"]["min_pixels"] = min_pixels
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def twin_images(root: Path) -> list:
    """Two PNGs of one size (so equal token ids) but different pixels: 168 x 126, a 9 x 12
    patch grid, 3 x 4 cells (`TWIN_SPAN` positions with `SMALL_MIN_PIXELS`)."""
    paths = []
    for k, colour in enumerate(((200, 30, 30), (30, 30, 200))):
        pixels = np.zeros((126, 168, 3), np.uint8) + np.array(colour, np.uint8)
        pixels[10:90, 5:60] = 255 - np.array(colour, np.uint8)
        paths.append(root / f"twin_{k}.png")
        Image.fromarray(pixels).save(paths[-1])
    return paths


def manifest() -> dict:
    return json.loads((VISION / "manifest.json").read_text())


def reference() -> dict:
    return mx.load(str(VISION / "reference.safetensors"))


def prompt_before_expansion() -> list:
    return manifest()["vision"]["prompt_ids_before_expansion"]
