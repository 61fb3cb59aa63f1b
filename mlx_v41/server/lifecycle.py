"""The server's life around its app: `Swap` listens before the model is loaded (with an app
that answers `GET /health` 503 {"status": "loading"} and every other route 503 in its API's
shape), then serves the real app once its lifespan has started; `Lifecycle` drains that app
when asked to stop: new requests get 503, requests whose reply has not begun end at once,
replies under way may finish within a grace period and the rest end with an error in their
API's shape. The engine stops, writing its prompt caches, at the lifespan's end.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Optional

from .auth import OPEN_PATHS
from .engine import Engine

log = logging.getLogger("mlx_v41.server")

LOADING, READY, DRAINING = "loading", "ok", "draining"  # the phases, as GET /health names them
DEFAULT_DRAIN_SECONDS = 30.0  # what replies under way get to finish once a stop is asked
END_SECONDS = 10.0  # then what the worker gets to end the rest (it stops at a chunk or token)
POLL_SECONDS = 0.05
REFUSALS = {LOADING: ("the model is loading: retry shortly", "model_loading"),
            DRAINING: ("the server is shutting down", "shutting_down")}


class Lifecycle:
    """One app's phase over its engine: ready once the lifespan started the engine, draining
    after `drain`. `on_drained()`, when set, runs once a drain is over (the CLI then stops
    uvicorn)."""

    def __init__(self, engine: Engine):
        self.engine, self.phase = engine, READY
        self.on_drained: Optional[Callable[[], None]] = None
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self._hurry: Optional[asyncio.Event] = None

    async def startup(self) -> None:
        """The lifespan's start: the engine's worker (its persisted prompt caches load)."""
        self.loop, self._hurry = asyncio.get_running_loop(), asyncio.Event()
        await asyncio.to_thread(self.engine.start)

    async def shutdown(self) -> None:
        """The lifespan's end: the engine ends what is left and writes its prompt caches."""
        await asyncio.to_thread(self.engine.close)

    async def drain(self, seconds: float = DEFAULT_DRAIN_SECONDS) -> None:
        """Stop admitting, end the requests whose reply has not begun, give the replies under
        way up to `seconds` (`hurry` cuts it short), end the rest with an error; then
        `on_drained`. A call while a drain runs returns at once."""
        if self.phase == DRAINING:
            return
        self.phase, engine = DRAINING, self.engine
        engine.drain()
        if engine.in_flight:
            log.info("stopping: %d requests in flight get up to %g s to finish",
                     engine.in_flight, seconds)
        await self._wait(seconds)
        if engine.in_flight:
            log.warning("stopping: %d replies not finished: ended with an error",
                        engine.in_flight)
            engine.end_all("the server shut down before the reply finished")
            await self._wait(END_SECONDS, is_hurried=False)
        if self.on_drained is not None:
            self.on_drained()

    def hurry(self) -> None:
        """End a drain's grace now (from any thread: a second Ctrl-C)."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._hurry.set)

    async def _wait(self, seconds: float, is_hurried: bool = True) -> None:
        deadline = self.loop.time() + seconds
        while self.engine.in_flight and self.loop.time() < deadline and \
                not (is_hurried and self._hurry.is_set()):
            await asyncio.sleep(POLL_SECONDS)


class Gate:
    """ASGI middleware: unless `phase()` is READY, an HTTP request to a path other than
    OPEN_PATHS gets `refuse(scope, message, code)` (a 503 in the API's shape)."""

    def __init__(self, app, phase: Callable[[], str], refuse: Callable):
        self.app, self.phase, self.refuse = app, phase, refuse

    async def __call__(self, scope, receive, send):
        phase = self.phase()
        if scope["type"] != "http" or phase == READY or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        await self.refuse(scope, *REFUSALS[phase])(scope, receive, send)


class Swap:
    """The ASGI app uvicorn serves: `first` (the loading app) until `swap(app)` has run `app`'s
    lifespan startup, then `app`, whose lifespan ends with the server's."""

    def __init__(self, first):
        self.app, self.loop = first, None
        self._lifespan: Optional[_Lifespan] = None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "lifespan":
            return await self.app(scope, receive, send)
        while (await receive())["type"] != "lifespan.shutdown":
            self.loop = asyncio.get_running_loop()
            await send({"type": "lifespan.startup.complete"})
        if self._lifespan is not None:
            await self._lifespan.shutdown()
        await send({"type": "lifespan.shutdown.complete"})

    async def swap(self, app) -> None:
        """Start `app`'s lifespan, then serve it (on the server's loop)."""
        lifespan = _Lifespan(app)
        await lifespan.startup()
        self._lifespan, self.app = lifespan, app


class _Lifespan:
    """An ASGI app's lifespan, driven by hand (as a server drives it)."""

    def __init__(self, app):
        self.app = app
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.task: Optional[asyncio.Task] = None

    async def startup(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"},
                 "state": {}}
        self.task = asyncio.ensure_future(self.app(scope, self.inbox.get, self.outbox.put))
        await self.inbox.put({"type": "lifespan.startup"})
        reply = asyncio.ensure_future(self.outbox.get())
        await asyncio.wait([reply, self.task], return_when=asyncio.FIRST_COMPLETED)
        if not reply.done():  # the app's lifespan ended first (an error: it raises here)
            reply.cancel()
            if self.outbox.empty():
                self.task.result()
                raise RuntimeError("the app's lifespan ended before it started")
            reply = self.outbox.get_nowait()
        else:
            reply = reply.result()
        if reply["type"] != "lifespan.startup.complete":  # the task re-raises the error
            await asyncio.wait([self.task])
            error = self.task.exception()
            raise RuntimeError(f"the app did not start: {error}") from error

    async def shutdown(self) -> None:
        await self.inbox.put({"type": "lifespan.shutdown"})
        await self.task
