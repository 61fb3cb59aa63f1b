"""The FastAPI app: every API's routes (OpenAI chat completions and completions in openai/,
Responses in responses/, Anthropic Messages in anthropic/, Ollama's API in ollama/) over
one engine, `GET /v1/models`, `GET /health` and the chat page at `/` (web/), and the errors
of every route in its API's shape (a failure no handler took becomes a 500 in that shape);
API keys, CORS and the drain's 503s are middleware over every route (auth.py, lifecycle.py),
and `create_loading_app` answers while the model loads.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import Callable, Literal, Optional

# mlx-lm first: it silences transformers' advisory warnings ("PyTorch was not found") before
# the constraints' llguidance imports transformers.
import mlx_lm  # noqa: F401
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.routing import Match

from .anthropic import routes as anthropic_routes
from .auth import OPEN_PATHS, add_cors, add_keys
from .engine import Engine, EngineBusy, EngineClosed
from .bodies import ERROR_STATUSES
from .errors import ErrorBody, RequestError, error_body
from .ollama import routes as ollama_routes
from .openai import routes as openai_routes
from .responses import routes as responses_routes
from .web import routes as web_routes
from .metrics import RequestMetrics, ServerMetrics
from .lifecycle import LOADING, READY, Gate, Lifecycle
from .serving import ServerConfig

log = logging.getLogger("mlx_v41.server")
RETRY_AFTER_SECONDS = 1  # a 429's Retry-After: a slot frees when any running request ends


def create_app(engine: Engine, config: ServerConfig,
               logits_processors: Optional[Callable] = None, *, api_keys=(),
               allowed_origins=()) -> FastAPI:
    """The app over a (not yet started) engine; its lifespan starts and closes the engine
    (`app.state.lifecycle.drain()` stops it gracefully first).

    `logits_processors(request, prompt_ids)`, when given, returns extra mlx-lm logits
    processors for a request (an embedding application's hook, e.g. constrained decoding).
    `api_keys`: every route but `GET /health` (and the chat page's files, which
    `config.web` serves) needs one of them (none: no check);
    `allowed_origins`: the browser origins CORS allows ("*": any; none: CORS off).
    """
    lifecycle = Lifecycle(engine)

    @asynccontextmanager
    async def lifespan(app):
        await lifecycle.startup()  # loads the persisted prompt caches
        yield
        await lifecycle.shutdown()

    app = FastAPI(title="mlx_v41", lifespan=lifespan)
    app.state.engine, app.state.config = engine, config
    app.state.logits_processors = logits_processors
    app.state.lifecycle = lifecycle
    _add_error_handlers(app)
    _add_access(app, lambda: lifecycle.phase, api_keys,
                OPEN_PATHS | web_routes.PATHS if config.web else OPEN_PATHS)
    _add_metrics(app, engine)
    add_cors(app, allowed_origins)  # outermost: a preflight, which carries no key, is answered
    _add_routes(app)
    return app


def create_loading_app(api_keys=(), allowed_origins=()) -> FastAPI:
    """What the server answers while the model loads (lifecycle.Swap serves it first):
    `GET /health` 503 {"status": "loading"}, every other route 503 in its API's shape, behind
    the same keys and CORS as `create_app`'s."""
    app = FastAPI(title="mlx_v41", openapi_url=None)
    _add_access(app, lambda: LOADING, api_keys)
    add_cors(app, allowed_origins)

    @app.get("/health")
    async def health():
        return JSONResponse({"status": LOADING}, status_code=503)

    return app


def _error_response(path: str, status: int, message: str, headers: Optional[dict] = None,
                    details: Optional[dict] = None, **fields) -> JSONResponse:
    """An error in the shape of the API that `path` belongs to: Anthropic's (with its
    `details`) under its Messages API's paths, Ollama's under its API's, else OpenAI's (with
    `fields`: kind, param, code)."""
    if path.startswith(anthropic_routes.PATH):
        body = anthropic_routes.error_body(status, message, details)
    elif path.startswith(ollama_routes.PATH):
        body = ollama_routes.error_body(message)
    else:
        body = error_body(message, **fields)
    return JSONResponse(body, status_code=status, headers=headers)


def _add_access(app: FastAPI, phase: Callable[[], str], api_keys,
                open_paths=OPEN_PATHS) -> None:
    """The 503s of a server not ready (loading, draining) inside the key check (a 401 comes
    first, and tells nothing of the server's state); `open_paths` need no key."""
    app.add_middleware(Gate, phase=phase, refuse=lambda scope, message, code: _error_response(
        scope["path"], 503, message, kind="server_error", code=code))
    add_keys(app, api_keys, refuse=lambda scope, message: _error_response(
        scope["path"], 401, message, {"WWW-Authenticate": "Bearer"},
        kind="invalid_request_error", code="invalid_api_key"), open_paths=open_paths)


def _add_error_handlers(app: FastAPI) -> None:
    def error(request, status: int, message: str, **fields) -> JSONResponse:  # a route's
        return _error_response(request.url.path, status, message, **fields)

    @app.exception_handler(RequestError)
    async def request_error(request, e: RequestError):
        return error(request, e.status, str(e), kind=e.kind, param=e.param, code=e.code,
                     details=e.details)

    @app.exception_handler(RecursionError)
    async def too_deep(request, e):
        # json.loads (or a walk over the decoded body) ran out of Python's recursion limit
        return error(request, 400, "the request body is nested too deeply to be read",
                     kind="invalid_request_error")

    @app.exception_handler(EngineBusy)
    async def busy(request, e):
        return error(request, 429, str(e), headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
                     kind="rate_limit_error", code="server_busy")

    @app.exception_handler(EngineClosed)
    async def closed(request, e):
        return error(request, 503, str(e), kind="server_error", code="shutting_down")

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        headers = dict(e.headers or {})
        if e.status_code == 405:  # Starlette's Allow names the first route of the path only
            headers["Allow"] = ", ".join(_allowed_methods(app, request.scope))
        return error(request, e.status_code, str(e.detail), headers=headers,
                     kind="invalid_request_error")

    def internal(request, e: Exception) -> JSONResponse:
        log.exception("request failed", exc_info=e)
        return error(request, 500, f"internal error: {type(e).__name__}: {e}",
                     kind="server_error")

    app.add_middleware(_InternalErrors, respond=internal)


def _allowed_methods(app: FastAPI, scope) -> list:
    """The methods of every route at the request's path (a 405's `Allow`)."""
    methods = set()
    for route in app.router.routes:
        if route.matches(scope)[0] != Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return sorted(methods)


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


def _add_metrics(app: FastAPI, engine: Engine) -> None:
    """Prometheus metrics (`GET /metrics`): the engine reports to them, and a middleware
    outside the middlewares added before it counts each answer, theirs (a 500) included."""
    app.state.metrics = engine.observer = ServerMetrics(engine)
    app.add_middleware(RequestMetrics, metrics=app.state.metrics)

    @app.get("/metrics", response_class=PlainTextResponse, responses={
        200: {"description": "Prometheus' text format",
              "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}},
        **GET_ERRORS})
    async def metrics():
        return PlainTextResponse(app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


class Health(BaseModel):
    status: Literal["ok", "loading", "draining"]
    model: Optional[str] = None  # when "ok"


class ModelEntry(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelEntry]


# what a GET route behind the key check and the drain may answer besides its reply
GET_ERRORS = {status: {"model": ErrorBody, "description": ERROR_STATUSES[status]}
              for status in (401, 503)}


def _add_routes(app: FastAPI) -> None:
    @app.get("/health", response_model=Health, responses={
        503: {"model": Health, "description": "loading, or draining before a stop"}})
    async def health():
        phase = app.state.lifecycle.phase
        if phase != READY:  # draining: a load balancer sends new requests elsewhere
            return JSONResponse({"status": phase}, status_code=503)
        return {"status": "ok", "model": app.state.config.model_id}

    @app.get("/v1/models", response_model=ModelList, responses=GET_ERRORS)
    async def models():
        entry = {"id": app.state.config.model_id, "object": "model", "created": 0,
                 "owned_by": "mlx_v41"}
        return {"object": "list", "data": [entry]}

    openai_routes.add_routes(app)
    anthropic_routes.add_routes(app)
    responses_routes.add_routes(app)
    ollama_routes.add_routes(app)
    if app.state.config.web:
        web_routes.add_routes(app)


