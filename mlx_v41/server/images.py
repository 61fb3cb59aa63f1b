"""Image content parts of chat requests: OpenAI's `image_url` part (also spelled `image` and
`input_image`) carrying a base64 `data:` URI, decoded and checked here against the server's
limits before the request is queued. The server fetches no URL and reads no file on a
client's say-so: http(s) URLs and paths are refused by name.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from dataclasses import dataclass
from typing import Optional

from PIL import Image, UnidentifiedImageError

from ..model.vision.preprocess import ImageError, plan_image_grid
from ..model.vision.prompt import VISION_MISSING, has_vision
from .bodies import ContentPart
from .errors import RequestError

IMAGE_PART_TYPES = ("image_url", "image", "input_image")
IMAGE_ROLES = ("user", "tool")  # where the chat format renders image blocks
# Decoders PIL may use: the formats OpenAI accepts and BMP (no plugin that runs a program).
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
DEFAULT_MAX_IMAGE_BYTES = 20 * 10**6  # decoded bytes per image (OpenAI's per-image limit)
BASE64_IMAGE = "data:image/*;base64,"  # a bare base64 image as a data: URI (PIL finds its format)
DEFAULT_MAX_IMAGE_PIXELS = 8192 * 8192  # width x height; the plan shrinks every image anyway


def _error(where: str, message: str, code: str = "invalid_image") -> RequestError:
    return RequestError(f"{where}: {message}", param=where, code=code)


@dataclass(frozen=True)
class ImageReader:
    """Turns a request's image parts into chat image blocks (decoded RGB PIL images).
    `vision_config` is None for a model without the vision tower: every image part is a 400."""

    vision_config: Optional[object]
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS

    @classmethod
    def for_model(cls, model, max_bytes: int, max_pixels: int) -> "ImageReader":
        return cls(model.args.vision_config if has_vision(model) else None, max_bytes,
                   max_pixels)

    def block(self, part: ContentPart, role: str, where: str) -> dict:
        """The chat format's image block of one part; RequestError naming `where`."""
        self._check_role(role, where)
        return self._image_block(_data_uri(part, where), where)

    def base64_block(self, data: str, role: str, where: str) -> dict:
        """The image block of a bare base64 string (Ollama's `images`; a data: URI too)."""
        self._check_role(role, where)
        if data.lower().startswith(("http://", "https://")):
            raise _error(where, "image URLs are not fetched by this server; send the image's "
                         "bytes base64-encoded", "unsupported_content")
        return self._image_block(data if data.startswith("data:") else BASE64_IMAGE + data,
                                 where)

    def _check_role(self, role: str, where: str) -> None:
        if role not in IMAGE_ROLES:
            raise _error(where, f"image parts are allowed in user and tool messages, not in "
                         f"a {role!r} message", "unsupported_content")
        if self.vision_config is None:
            raise _error(where, f"image input needs the vision tower, but {VISION_MISSING}",
                         "unsupported_content")

    def _image_block(self, uri: str, where: str) -> dict:
        image = self._decode(uri, where)
        try:
            plan_image_grid(image.width, image.height, self.vision_config)
        except ImageError as e:
            raise _error(where, str(e)) from None
        return {"type": "image", "image": image}

    def _decode(self, uri: str, where: str) -> Image.Image:
        header, _, payload = uri.partition(",")
        media_type = header[len("data:"):].split(";")[0]
        if not header.endswith(";base64"):
            raise _error(where, "the data: URI is not base64 (expected data:image/png;base64,...)")
        if not media_type.startswith("image/"):
            raise _error(where, f"the data: URI's media type {media_type!r} is not an image type")
        if len(payload) > 4 * (-(-self.max_bytes // 3)):  # before decoding what is too large
            raise self._too_large(where, f"more than {self.max_bytes} bytes")
        try:
            data = base64.b64decode(payload, validate=True)
        except binascii.Error as e:
            raise _error(where, f"invalid base64 data ({e})") from None
        if len(data) > self.max_bytes:
            raise self._too_large(where, f"{len(data)} bytes")
        return self._open(data, where)

    def _open(self, data: bytes, where: str) -> Image.Image:
        """Decode `data`; its size is checked from the header, before the pixels are read."""
        with warnings.catch_warnings():  # PIL's bomb warning: our own pixel limit decides
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            try:
                image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
            except UnidentifiedImageError:
                raise _error(where, "not an image this server reads (PNG, JPEG, WebP, GIF or "
                             "BMP)") from None
            except Image.DecompressionBombError as e:
                raise self._too_large(where, str(e)) from None
            width, height = image.size
            if width * height > self.max_pixels:
                raise self._too_large(where, f"{width} x {height} pixels", self.max_pixels,
                                      "pixels")
            try:
                image.load()
                return image if image.mode == "RGB" else image.convert("RGB")
            except (OSError, ValueError, SyntaxError) as e:  # truncated or corrupt data
                raise _error(where, f"not a readable image ({e})") from None

    def _too_large(self, where: str, size: str, limit: Optional[int] = None,
                   unit: str = "bytes") -> RequestError:
        limit = self.max_bytes if limit is None else limit
        return _error(where, f"the image is too large ({size}; the server's limit is {limit} "
                      f"{unit})", "image_too_large")


def _data_uri(part: ContentPart, where: str) -> str:
    """The part's image as a `data:` URI string (OpenAI's `{"url": ...}` or a bare string)."""
    field = "image" if part.type == "image" and part.image is not None else "image_url"
    value = getattr(part, field)
    if isinstance(value, dict):
        value, field = value.get("url"), f"{field}.url"
    where = f"{where}.{field}"
    if not isinstance(value, str):
        raise _error(where, "expected a base64 data: URI (as a string or {\"url\": ...})")
    if value.startswith("data:"):
        return value
    if value.lower().startswith(("http://", "https://")):
        raise _error(where, "image URLs are not fetched by this server; send the image inline "
                     "as a base64 data: URI (data:image/png;base64,...)", "unsupported_content")
    raise _error(where, "an image must be a base64 data: URI (data:image/png;base64,...); paths "
                 "and other URLs are refused", "unsupported_content")
