"""Errors every API shares: `RequestError` (a request we refuse, with its HTTP status and the
field at fault) and OpenAI's error body, which the OpenAI routes and the app's own errors use
(the Anthropic routes answer in their own shape, `anthropic.routes.error_body`).
"""

from __future__ import annotations

from typing import Optional


class RequestError(ValueError):
    """A request we refuse: HTTP `status`, OpenAI error `code` and the `param` at fault."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None,
                 code: Optional[str] = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind


def error_body(message: str, kind: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
