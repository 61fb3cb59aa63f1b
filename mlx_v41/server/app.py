"""The FastAPI app: every API's routes (OpenAI chat completions and completions in openai/,
Responses in responses/, Anthropic Messages in anthropic/) over one engine, `GET /v1/models`
and `GET /health`, and the errors of every route in its API's shape (a failure no handler took
becomes a 500 in that shape).
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import Callable, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from .anthropic import routes as anthropic_routes
from .engine import Engine, EngineBusy, EngineClosed
from .errors import RequestError, error_body
from .openai import routes as openai_routes
from .responses import routes as responses_routes
from .serving import ServerConfig

log = logging.getLogger("mlx_v41.server")


def create_app(engine: Engine, config: ServerConfig,
               logits_processors: Optional[Callable] = None) -> FastAPI:
    """The app over a (not yet started) engine; its lifespan starts and closes the engine.

    `logits_processors(request, prompt_ids)`, when given, returns extra mlx-lm logits
    processors for a request (an embedding application's hook, e.g. constrained decoding).
    """

    @asynccontextmanager
    async def lifespan(app):
        await asyncio.to_thread(engine.start)  # loads the persisted prompt caches
        yield
        await asyncio.to_thread(engine.close)

    app = FastAPI(title="mlx_v41", lifespan=lifespan)
    app.state.engine, app.state.config = engine, config
    app.state.logits_processors = logits_processors
    _add_error_handlers(app)
    _add_routes(app)
    return app


def _error(status: int, message: str, **fields) -> JSONResponse:
    return JSONResponse(error_body(message, **fields), status_code=status)


def _add_error_handlers(app: FastAPI) -> None:
    def error(request, status: int, message: str, **fields) -> JSONResponse:
        """OpenAI's error shape, or Anthropic's under its Messages API's paths."""
        if request.url.path.startswith(anthropic_routes.PATH):
            return JSONResponse(anthropic_routes.error_body(status, message),
                                status_code=status)
        return _error(status, message, **fields)

    @app.exception_handler(RequestError)
    async def request_error(request, e: RequestError):
        return error(request, e.status, str(e), kind=e.kind, param=e.param, code=e.code)

    @app.exception_handler(EngineBusy)
    async def busy(request, e):
        return error(request, 429, str(e), kind="rate_limit_error", code="server_busy")

    @app.exception_handler(EngineClosed)
    async def closed(request, e):
        return error(request, 503, str(e), kind="server_error", code="shutting_down")

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return error(request, e.status_code, str(e.detail), kind="invalid_request_error")

    def internal(request, e: Exception) -> JSONResponse:
        log.exception("request failed", exc_info=e)
        return error(request, 500, f"internal error: {type(e).__name__}: {e}",
                     kind="server_error")

    app.add_middleware(_InternalErrors, respond=internal)


class _InternalErrors:
    """Turns an exception no handler took into a 500 in the API's shape, here rather than in
    Starlette's outermost handler, which answers and then re-raises, so that uvicorn closes
    the connection and a client reusing it fails on its next request."""

    def __init__(self, app, respond):
        self.app, self.respond = app, respond

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watched(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as e:
            if started:  # the response is under way: nothing else can be sent
                raise
            await self.respond(Request(scope), e)(scope, receive, send)


def _add_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        entry = {"id": app.state.config.model_id, "object": "model", "created": 0,
                 "owned_by": "mlx_v41"}
        return {"object": "list", "data": [entry]}

    openai_routes.add_routes(app)
    anthropic_routes.add_routes(app)
    responses_routes.add_routes(app)


