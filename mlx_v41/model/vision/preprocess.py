"""Image preprocessing: decode, plan the resize grid, pad-resize, normalise, cut into patches
(official inference/image_processor.py `load_image`, `plan_image_grid`, `safe_resize`).

The plan keeps every image's span within `max_image_tokens` positions: small images are scaled
up to `min_pixels`, every side is rounded up to whole patches, and a span that would be too long
is shrunk onto whole 3x3 cells. The original image is then fitted into the planned size with
PIL's `ImageOps.pad` (aspect kept, grey bars, centred).
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import io
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import mlx.core as mx
import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

PAD_COLOR = (127, 127, 127)  # the reference's padding colour
URL_TIMEOUT_SECONDS = 30.0


class ImageError(ValueError):
    """An image cannot be read or used; the message names it."""


@dataclass(frozen=True)
class ImageGrid:
    """The resize plan of one image: the padded size and its ViT and LLM grids."""

    width: int          # padded size fed to the ViT (multiples of the patch size)
    height: int
    vit_h: int          # patches per column / row
    vit_w: int
    llm_h: int          # 3x3 cells (image tokens) per column / row
    llm_w: int

    @property
    def span_tokens(self) -> int:
        """Positions of the image's span: start, rows of cells each ending in a newline, end."""
        return self.llm_h * (self.llm_w + 1) + 2


@dataclass(frozen=True, eq=False)
class PreparedImage:
    """One image planned for the tower: the decoded RGB image, its grid, the sha256 of its
    pixels, and `patches` [n, 3 * patch * patch] bf16 in (channel, y, x) order, row-major over
    the ViT grid. The patches are made on first use, so planning a prompt builds no MLX graph
    (a server plans on its request thread and runs the tower on its engine thread)."""

    image: Image.Image
    grid: ImageGrid
    sha256: str
    patch_size: int

    @functools.cached_property
    def patches(self) -> mx.array:
        pixels = normalize(resize_and_pad(self.image, self.grid))
        return patchify(pixels, self.patch_size)


def _cells(patches: int, ratio: int) -> int:
    return -(-patches // ratio)


def _grid(width: int, height: int, patch: int, ratio: int) -> ImageGrid:
    vit_h, vit_w = height // patch, width // patch
    return ImageGrid(width, height, vit_h, vit_w, _cells(vit_h, ratio), _cells(vit_w, ratio))


def plan_image_grid(width: int, height: int, cfg) -> ImageGrid:
    """The padded size and grids of a `width` x `height` image under `cfg` (a VisionConfig)."""
    if width <= 0 or height <= 0:
        raise ImageError(f"image size {width}x{height} is empty")
    patch, ratio = cfg.patch_size, cfg.downsample_ratio
    if cfg.max_wh_ratio:
        raise ImageError("vision_config.max_wh_ratio is not supported (the released value "
                         "is null)")
    if width * height < cfg.min_pixels:
        scale = math.sqrt(cfg.min_pixels / (width * height))
        width, height = int(width * scale), int(height * scale)
    grid = _grid(-(-width // patch) * patch, -(-height // patch) * patch, patch, ratio)
    if grid.span_tokens > cfg.max_image_tokens:
        grid = _shrunk_grid(width, height, cfg)
    return grid


def _shrunk_grid(width: int, height: int, cfg) -> ImageGrid:
    """`solve_resize_ratio`: the largest whole-cell size whose span fits `max_image_tokens`."""
    patch, ratio = cfg.patch_size, cfg.downsample_ratio
    cell = patch * ratio
    budget = cfg.max_image_tokens - 2            # the span's start and end positions
    aspect = height / width
    most_w = math.sqrt(budget / aspect + 0.25) - 0.5   # cells per row, newline included
    most_h = most_w * aspect
    if most_w < 1:
        size = (cell, (budget // 2) * cell)      # one cell per row: cell + newline per row
    elif most_h < 1:
        size = ((budget - 1) * cell, cell)       # one row of cells and its newline
    else:
        beta = min(math.floor(most_w) * cell / width, math.floor(most_h) * cell / height)
        size = (math.floor(width * beta / patch) * patch, math.floor(height * beta / patch) * patch)
    grid = _grid(*size, patch, ratio)
    if grid.span_tokens > cfg.max_image_tokens:  # the reference asserts the same
        raise ImageError(f"a {width}x{height} image does not fit {cfg.max_image_tokens} tokens")
    return grid


ImageSource = Union[str, Path, bytes, Image.Image, dict]


def load_image(source: ImageSource) -> Image.Image:
    """An RGB PIL image from a path, bytes, a base64 `data:` URI, an http(s) URL, a PIL image
    or a chat image block (`{"type": "image", "image": ...}` / `{"type": "image_url",
    "image_url": {"url": ...}}`). Grayscale, palette and RGBA images are converted to RGB
    (the alpha channel is dropped, as the reference's `convert("RGB")` does)."""
    name = _describe(source)
    source = _unwrap_block(source)
    if isinstance(source, Image.Image):
        image = source
    else:
        data = _read_bytes(source, name)
        try:
            image = Image.open(io.BytesIO(data))
            image.load()
        except UnidentifiedImageError:
            raise ImageError(f"{name}: not a readable image (unknown format)") from None
        except (OSError, ValueError) as e:
            raise ImageError(f"{name}: not a readable image ({e})") from None
    return image if image.mode == "RGB" else image.convert("RGB")


def image_reference(source: ImageSource) -> str:
    """A JSON-storable reference to an image for a chat transcript: a path or URL as text;
    bytes and PIL images as a base64 PNG `data:` URI."""
    if isinstance(source, (str, Path)):
        return str(source)
    if isinstance(source, Image.Image):
        buffer = io.BytesIO()
        source.save(buffer, format="PNG")
        source = buffer.getvalue()
    if isinstance(source, (bytes, bytearray)):
        return "data:image/png;base64," + base64.b64encode(bytes(source)).decode()
    raise ImageError(f"cannot use {type(source).__name__} as an image")


def _unwrap_block(source):
    if not isinstance(source, dict):
        return source
    kind = source.get("type")
    value = source.get("image_url") if kind == "image_url" else source.get("image")
    if isinstance(value, dict):
        value = value.get("url")
    if value is None:
        raise ImageError(f"image block {_short(source)} has no image (expected 'image' or "
                         "'image_url': {'url': ...})")
    return value


def _read_bytes(source, name: str) -> bytes:
    if isinstance(source, (bytes, bytearray)):
        return bytes(source)
    if not isinstance(source, (str, Path)):
        raise ImageError(f"cannot read an image from {type(source).__name__}")
    text = str(source)
    if text.startswith("data:"):
        header, _, payload = text.partition(",")
        try:
            return base64.b64decode(payload, validate=True) if header.endswith(";base64") \
                else payload.encode()
        except binascii.Error as e:
            raise ImageError(f"{name}: invalid base64 data ({e})") from None
    if text.startswith(("http://", "https://")):
        return _fetch(text)
    path = Path(text).expanduser()
    try:
        return path.read_bytes()
    except OSError as e:
        raise ImageError(f"{path}: cannot read the image file ({e.strerror})") from None


def _fetch(url: str) -> bytes:
    from urllib.error import URLError
    from urllib.request import urlopen

    try:
        with urlopen(url, timeout=URL_TIMEOUT_SECONDS) as response:
            return response.read()
    except (URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise ImageError(f"{url}: cannot fetch the image ({reason})") from None


def _describe(source) -> str:
    if isinstance(source, dict):
        return f"image block {_short(source)}"
    if isinstance(source, (bytes, bytearray)):
        return f"image bytes ({len(source)} bytes)"
    if isinstance(source, Image.Image):
        return "PIL image"
    return _short(source)


def _short(value, limit: int = 60) -> str:
    """`value` for an error message: a path or URL whole (it names the culprit), anything
    else (a data: URL, an image block) cut to `limit` characters."""
    text = str(value)
    if len(text) <= limit or (isinstance(value, (str, os.PathLike)) and len(text) <= PATH_LIMIT
                              and not text.startswith("data:")):
        return text
    return text[:limit] + "..."


PATH_LIMIT = 4096  # longer "paths" are cut like other values (PATH_MAX on Linux)


def resize_and_pad(image: Image.Image, grid: ImageGrid) -> Image.Image:
    """The original image fitted into the planned size (PIL's default resampling for `pad`)."""
    return ImageOps.pad(image, (grid.width, grid.height), color=PAD_COLOR)


def normalize(image: Image.Image) -> mx.array:
    """RGB pixels -> [3, H, W] bf16 in [-1, 1]: ((v / 255) - 0.5) / 0.5 in fp32, then bf16."""
    pixels = np.asarray(image, dtype=np.float32) / np.float32(255.0)
    pixels = (pixels - np.float32(0.5)) / np.float32(0.5)
    return mx.array(pixels.transpose(2, 0, 1)).astype(mx.bfloat16)


def patchify(pixels: mx.array, patch: int) -> mx.array:
    """[3, H, W] -> [(H / p) * (W / p), 3 * p * p], patches row-major, each (channel, y, x)."""
    channels, height, width = pixels.shape
    grid = pixels.reshape(channels, height // patch, patch, width // patch, patch)
    grid = grid.transpose(1, 3, 0, 2, 4)
    return grid.reshape(-1, channels * patch * patch)


def prepare_image(source: ImageSource, cfg) -> PreparedImage:
    """Decode and plan one image for `cfg` (a VisionConfig); its patches (pad-resized,
    normalised) are made when first read."""
    image = load_image(source)
    grid = plan_image_grid(image.width, image.height, cfg)
    return PreparedImage(image, grid, pixel_hash(image), cfg.patch_size)


def pixel_hash(image: Image.Image) -> str:
    """sha256 of an RGB image's size and pixels: what its positions in a cache came from."""
    digest = hashlib.sha256(f"{image.width}x{image.height}:".encode())
    digest.update(np.asarray(image, dtype=np.uint8).tobytes())
    return digest.hexdigest()

