"""What every API's request bodies share: strict pydantic models (`StrictBody`), content
parts, and the check that refuses lone surrogates in any string of a body (`check_text`).
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict

from .errors import RequestError


class StrictBody(BaseModel):
    """A request body of any API: strict types, unknown fields ignored, no NaN or Infinity."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class ContentPart(StrictBody):
    type: str
    text: Optional[str] = None
    image_url: Optional[Any] = None  # {"url": "data:..."} or the URI itself
    image: Optional[Any] = None  # the same, under the name of the "image" part type


def check_text(value, where: str) -> None:
    """Refuse a string (or key) holding a lone surrogate, which JSON's "\\ud800" escapes
    allow but UTF-8 cannot carry; `where` names it as a validation error's location would."""
    if isinstance(value, str):
        _check_string(value, where, "")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_string(key, where, "a key's ")
            check_text(item, f"{where}.{key}" if where else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_text(item, f"{where}.{i}")


def _check_string(text: str, where: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"{where or 'body'}: {what}lone surrogate U+{ord(text[e.start]):04X} "
                           f"at character {e.start} is not valid text", param=where or None
                           ) from None
