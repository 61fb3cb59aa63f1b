"""What every API's routes share: the server's settings (`ServerConfig`), reading a body,
rendering a chat and expanding a prompt's images, queueing a request's choices (`submit`),
streaming SSE (or NDJSON lines) and awaiting a result while watching for the client to leave.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from ..chat import format as cf
from ..generation.api import PromptTooLongError, check_context
from ..model.vision.prompt import ImagePrompt, prepare_prompt
from .engine import EngineClosed, Settings, Token
from .images import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS
from .processors import processors_from
from ..generation.sequence import MAX_SEED
from .errors import RequestError

DEFAULT_MODEL_ALIAS = "default_model"  # mlx-lm's name for the model the server loaded
DEFAULT_MAX_TOKENS = 512  # mlx-lm server's default
# Streams send a keepalive after this long without an event: well under the read timeouts of
# clients and proxies (often 30-60 s), so a long prefill does not look like a dead server.
DEFAULT_KEEPALIVE_SECONDS = 10.0
SSE_KEEPALIVE = ": keepalive\n\n"  # an SSE comment: clients skip it


@dataclass
class ServerConfig:
    """What the CLI decides for every request: the served name, the values of fields a
    request leaves out (here: greedy, no filters, as mlx-lm's sampler without settings) and
    the limits on each image part (decoded bytes, width x height) and on a prompt's tokens
    (None: the model's context), the seconds without an event after which a stream sends
    a keepalive (0: never), and whether `/` serves the chat page (`web`)."""

    model_id: str
    max_tokens: int = DEFAULT_MAX_TOKENS
    temp: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    top_k: int = 0
    thinking: bool = True
    reasoning_effort: object = None
    system_prompt: Optional[str] = None
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_prompt_tokens: Optional[int] = None
    keepalive_seconds: float = DEFAULT_KEEPALIVE_SECONDS
    web: bool = True

    def settings(self, *, max_tokens: Optional[int] = None, temp: Optional[float] = None,
                 top_p: Optional[float] = None, min_p: Optional[float] = None,
                 top_k: Optional[int] = None, **fields) -> Settings:
        """A request's `Settings`: each value it leaves out (None) is this server's. A top_p
        of 0 keeps the most likely token alone: greedy decoding, whatever the temperature."""
        def pick(value, default):
            return default if value is None else value
        top_p = pick(top_p, self.top_p)
        return Settings(max_tokens=pick(max_tokens, self.max_tokens),
                        temp=0.0 if top_p == 0 else pick(temp, self.temp), top_p=top_p,
                        min_p=pick(min_p, self.min_p), top_k=pick(top_k, self.top_k), **fields)

    def check_model(self, name: Optional[str]) -> None:
        if name not in (None, self.model_id, Path(self.model_id).name, DEFAULT_MODEL_ALIAS):
            raise RequestError(f"the model {name!r} does not exist: this server serves "
                               f"{self.model_id!r}", status=404, param="model",
                               code="model_not_found")


async def read_json(request: Request):
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON ({e})") from None


def expanded_prompt(app: FastAPI, ids: list, images: list, param: str) -> ImagePrompt:
    """`ids` with each image placeholder expanded into its image's span (as generate does)."""
    try:
        return prepare_prompt(app.state.engine.model, ids, images)
    except ValueError as e:
        raise RequestError(str(e), param=param) from None


def chat_prompt(app: FastAPI, messages: list, tools: list, *, thinking: bool, effort,
                param: str, hint: str = "", continue_final: bool = True) -> ImagePrompt:
    """`messages` (`chat.format` dicts) rendered with V4.1's chat format, `tools` (function
    specs) in the system message and, with `continue_final`, a last assistant message
    continued (Anthropic's and Ollama's prefill; OpenAI's APIs start a new reply after it),
    with its images' spans expanded; a RequestError naming `param` (`hint` ends the one for a
    tokenizer without the chat format's tokens)."""
    tokenizer = app.state.engine.tokenizer
    if tokenizer.missing_chat_tokens:
        raise RequestError(f"the tokenizer has no single token for "
                           f"{tokenizer.missing_chat_tokens[0]}{hint}", param=param)
    try:
        ids = tokenizer.apply_chat_template(
            messages, tools=[{"type": "function", "function": t} for t in tools] or None,
            enable_thinking=thinking, reasoning_effort=effort,
            continue_final_message=continue_final and messages[-1]["role"] == "assistant")
    except ValueError as e:
        raise RequestError(str(e), param=param) from None
    return expanded_prompt(app, ids, cf.collect_images(messages), param)


def submit(app: FastAPI, prompt: ImagePrompt, settings: Settings, *, n: int = 1,
           param: str = "messages", body=None) -> list:
    """Queue a request of any API: checks the prompt's length (RequestError naming `param`),
    makes each choice's processors from `settings.processor_fields` (fresh ones per choice:
    a constraint's processor keeps state) plus the app's hook (given `body`), and returns one
    job per choice (`n`; with a seed, choice i samples with seed + i)."""
    engine, limit = app.state.engine, app.state.config.max_prompt_tokens
    if limit is not None and len(prompt.ids) > limit:
        raise RequestError(f"the prompt has {len(prompt.ids):,} tokens, more than this "
                           f"server's limit of {limit:,} (--max-prompt-tokens)", param=param,
                           code="context_length_exceeded")
    try:
        check_context(engine.model, 0, len(prompt.ids))
    except PromptTooLongError as e:
        raise RequestError(str(e), param=param, code="context_length_exceeded") from None
    choices = [dataclasses.replace(settings, seed=None if settings.seed is None else
                                   (settings.seed + i) % (MAX_SEED + 1),
                                   processors=_processors(app, settings, body, prompt.ids))
               for i in range(n)]
    if n == 1:
        return [engine.submit(prompt, choices[0])]
    # n choices: one sequence each, from one prefill where the engine batches
    return engine.submit_many(prompt, choices)


def _processors(app: FastAPI, settings: Settings, body, prompt: list) -> list:
    processors = processors_from(settings.processor_fields, app.state.engine.tokenizer)
    if app.state.logits_processors is not None and body is not None:
        processors += list(app.state.logits_processors(body, prompt))
    return processors


def sse_response(events, jobs: list, keepalive: str = SSE_KEEPALIVE,
                 is_after_first: bool = False,
                 media_type: str = "text/event-stream") -> StreamingResponse:
    """An SSE stream of `events` (text) for `jobs`, which it cancels if the client leaves;
    `keepalive` is sent whenever no event came for the app's `keepalive_seconds` (with
    `is_after_first`, only once the first event went out: Anthropic's pings follow
    message_start). `media_type`: another stream of text events (Ollama's NDJSON lines)."""
    async def guarded():
        try:
            async for text in events:
                yield text
        finally:  # the client went away (or the stream ended): stop the generation
            for job in jobs:
                if job.finish is None:
                    job.cancel()
    return _EventStream(guarded(), keepalive, is_after_first, media_type)


class _EventStream(StreamingResponse):
    """A `StreamingResponse` of SSE events with keepalives; the interval is the serving app's
    (`scope["app"]`), read when the response starts."""

    def __init__(self, events, keepalive: str, is_after_first: bool, media_type: str):
        super().__init__(events, media_type=media_type, headers={"Cache-Control": "no-cache"})
        self.keepalive, self.is_after_first = keepalive, is_after_first

    async def __call__(self, scope, receive, send):
        seconds = scope["app"].state.config.keepalive_seconds
        if seconds > 0:
            self.body_iterator = with_keepalives(self.body_iterator, seconds, self.keepalive,
                                                 self.is_after_first)
        await super().__call__(scope, receive, send)


async def with_keepalives(events, seconds: float, keepalive: str, is_after_first: bool = False):
    """`events` with `keepalive` yielded whenever the next one takes longer than `seconds`.
    The wait for an event is a task that a timeout leaves running (cancelling it would cancel
    the generator's own await); it is cancelled only when this stream closes early."""
    events = aiter(events)
    pending = None
    is_started = not is_after_first
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({pending}, timeout=seconds if is_started else None)
            if not done:
                yield keepalive
                continue
            task, pending = pending, None
            try:
                text = task.result()
            except StopAsyncIteration:
                return
            is_started = True
            yield text
    finally:
        if pending is not None:  # the client left while an event was awaited
            pending.cancel()
        else:
            await events.aclose()


async def until_done(request: Request, jobs: list, result):
    """Await a non-streamed result; a client that disconnects first cancels the jobs."""
    async def watch():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        for job in jobs:
            job.cancel()

    watcher = asyncio.create_task(watch())
    try:
        return await result
    finally:
        watcher.cancel()


async def collect(job) -> tuple:
    tokens, finish = [], None
    async for event in job.events():
        if isinstance(event, Token):
            tokens.append(event)
        else:
            finish = event
    return tokens, finish


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


@dataclass
class Failure:
    """How a request that failed after it was accepted is reported: an `EngineClosed` (the
    server is draining or stopping) as a 503 `shutting_down` with its own message, anything else
    as a 500 internal error naming the exception."""

    status: int
    message: str
    code: Optional[str] = None
    kind: str = "server_error"


def failure(error: BaseException) -> Failure:
    if isinstance(error, EngineClosed):
        return Failure(503, str(error), "shutting_down")
    return Failure(500, f"internal error: {type(error).__name__}: {error}")
