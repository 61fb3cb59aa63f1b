"""Errors every API shares: `RequestError` (a request we refuse, with its HTTP status and the
field at fault), how a field's location is spelled in each API's errors (`field_path`), and
OpenAI's error body (`error_body`, `ErrorBody`), which the OpenAI and Responses routes and the
app's own errors use (the Anthropic routes answer in their own shape).
"""

from __future__ import annotations

from typing import Optional

from pydantic import BaseModel


class RequestError(ValueError):
    """A request we refuse: HTTP `status`, OpenAI error `code`, the `param` at fault and, for
    an API whose errors carry them, machine-readable `details`."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None,
                 code: Optional[str] = None, kind: str = "invalid_request_error",
                 details: Optional[dict] = None):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind
        self.details = details


def field_path(parts, dotted: bool = False, prefix: str = "") -> str:
    """A field's location as the API's errors spell it: OpenAI's `messages[1].content[0]`,
    or Anthropic's `messages.1.content.0` (`dotted`), after `prefix`."""
    out = prefix
    for part in parts:
        if isinstance(part, int) and not dotted:
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def error_body(message: str, kind: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str]
    code: Optional[str]


class ErrorBody(BaseModel):
    """OpenAI's error body, `error_body`'s shape."""

    error: ErrorDetail
