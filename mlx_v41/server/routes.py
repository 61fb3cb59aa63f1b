"""The FastAPI app: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`,
`GET /health`. Routes validate, render the prompt (image placeholders expanded into their
spans) and hand it to the engine; errors come back in OpenAI's JSON shape; a client that goes
away cancels its request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from ..chat import format as cf
from ..generation.api import PromptTooLongError, check_context
from ..model.vision.prompt import ImagePrompt, prepare_prompt
from .engine import Engine, EngineBusy, EngineClosed, Settings, Token
from .images import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS, ImageReader
from .messages import allows_tool_calls, chat_messages, thinking_mode
from .processors import processor_fields, processors_from
from .protocol import (MAX_SEED, ChatCompletionRequest, CompletionRequest, RequestError,
                       parse_body)
from .reply_parser import Reply, ReplyParser, parse_reply
from . import responses as out

log = logging.getLogger("mlx_v41.server")
DEFAULT_MODEL_ALIAS = "default_model"  # mlx-lm's name for the model the server loaded
DEFAULT_MAX_TOKENS = 512  # mlx-lm server's default


@dataclass
class ServerConfig:
    """What the CLI decides for every request: the served name, the values of fields a
    request leaves out (here: greedy, no filters, as mlx-lm's sampler without settings) and
    the limits on each image part (decoded bytes, width x height) and on a prompt's tokens
    (None: the model's context)."""

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

    def check_model(self, name: Optional[str]) -> None:
        if name not in (None, self.model_id, Path(self.model_id).name, DEFAULT_MODEL_ALIAS):
            raise RequestError(f"the model {name!r} does not exist: this server serves "
                               f"{self.model_id!r}", status=404, param="model",
                               code="model_not_found")


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
    app.state.token_text = out.TokenText(engine.tokenizer)
    _add_error_handlers(app)
    _add_routes(app)
    return app


def _error(status: int, message: str, **fields) -> JSONResponse:
    return JSONResponse(out.error_body(message, **fields), status_code=status)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def request_error(request, e: RequestError):
        return _error(e.status, str(e), kind=e.kind, param=e.param, code=e.code)

    @app.exception_handler(EngineBusy)
    async def busy(request, e):
        return _error(429, str(e), kind="rate_limit_error", code="server_busy")

    @app.exception_handler(EngineClosed)
    async def closed(request, e):
        return _error(503, str(e), kind="server_error", code="shutting_down")

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return _error(e.status_code, str(e.detail), kind="invalid_request_error")

    @app.exception_handler(Exception)
    async def internal(request, e):
        log.exception("request failed")
        return _error(500, f"internal error: {type(e).__name__}: {e}", kind="server_error")


def _add_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        entry = {"id": app.state.config.model_id, "object": "model", "created": 0,
                 "owned_by": "mlx_v41"}
        return {"object": "list", "data": [entry]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = parse_body(ChatCompletionRequest, await _json(request))
        app.state.config.check_model(body.model)
        prompt, thinking, allow_calls = _chat_prompt(app, body)
        jobs = _submit(app, body, prompt, allow_calls)
        if body.stream:
            stream = out.ChatStream(app.state.config.model_id, app.state.token_text)
            return _sse(_merged([_chat_stream(app, body, job, thinking, stream.choice(i),
                                              len(jobs) == 1)
                                 for i, job in enumerate(jobs)], body, jobs, stream), jobs)
        return await _until_done(request, jobs, _gathered(
            [_chat_result(app, job, thinking) for job in jobs]))

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = parse_body(CompletionRequest, await _json(request))
        app.state.config.check_model(body.model)
        jobs = _submit(app, body, _completion_prompt(app, body), True)
        if body.stream:
            cid, created = out.new_id("cmpl-"), int(time.time())
            return _sse(_merged([_completion_stream(app, body, job, cid, created, i,
                                                    len(jobs) == 1)
                                 for i, job in enumerate(jobs)], body, jobs, None,
                                (cid, created, app.state.config.model_id)), jobs)
        return await _until_done(request, jobs, _gathered(
            [_completion_result(app, job) for job in jobs]))


async def _json(request: Request):
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON ({e})") from None


def _chat_prompt(app: FastAPI, body: ChatCompletionRequest) -> tuple:
    """(`ImagePrompt`, thinking mode, whether tool calls may be generated)."""
    config, engine = app.state.config, app.state.engine
    tokenizer = engine.tokenizer
    images = ImageReader.for_model(engine.model, config.max_image_bytes, config.max_image_pixels)
    messages = chat_messages(body, config.system_prompt, images)
    thinking, effort = thinking_mode(body, config.thinking, config.reasoning_effort)
    allow_calls = allows_tool_calls(body)
    if tokenizer.missing_chat_tokens:
        raise RequestError(f"the tokenizer has no single token for "
                           f"{tokenizer.missing_chat_tokens[0]}: use /v1/completions",
                           param="messages")
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools or ()]
    try:
        prompt = tokenizer.apply_chat_template(messages, tools=tools or None,
                                               enable_thinking=thinking,
                                               reasoning_effort=effort)
    except ValueError as e:
        raise RequestError(str(e), param="messages") from None
    return _expanded(app, prompt, cf.collect_images(messages), "messages"), thinking, allow_calls


def _expanded(app: FastAPI, ids: list, images: list, param: str) -> ImagePrompt:
    """`ids` with each image placeholder expanded into its image's span (as generate does)."""
    try:
        return prepare_prompt(app.state.engine.model, ids, images)
    except ValueError as e:
        raise RequestError(str(e), param=param) from None


def _completion_prompt(app: FastAPI, body: CompletionRequest) -> ImagePrompt:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise RequestError("one prompt per request (a list of prompts is not supported)",
                               param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return _expanded(app, app.state.engine.tokenizer.encode_prompt(prompt), [], "prompt")
    if not prompt:
        raise RequestError("prompt is empty", param="prompt")
    vocab = app.state.engine.model.args.text_config.vocab_size
    if not all(0 <= t < vocab for t in prompt):
        raise RequestError(f"prompt token ids must lie in 0..{vocab - 1}", param="prompt")
    return _expanded(app, list(prompt), [], "prompt")


def _submit(app: FastAPI, body, prompt: ImagePrompt, allow_calls: bool):
    engine, limit = app.state.engine, app.state.config.max_prompt_tokens
    param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    if limit is not None and len(prompt.ids) > limit:
        raise RequestError(f"the prompt has {len(prompt.ids):,} tokens, more than this "
                           f"server's limit of {limit:,} (--max-prompt-tokens)", param=param,
                           code="context_length_exceeded")
    try:
        check_context(engine.model, 0, len(prompt.ids))
    except PromptTooLongError as e:
        raise RequestError(str(e), param=param, code="context_length_exceeded") from None
    settings = _settings(app, body, prompt.ids, allow_calls)
    if body.n == 1:
        return [engine.submit(prompt, settings)]
    # n choices: one sequence each, from one prefill where the engine batches; with a seed,
    # choice i samples with seed + i (so each is what a request with that seed gives)
    choices = [dataclasses.replace(settings, seed=None if settings.seed is None else
                                   (settings.seed + i) % (MAX_SEED + 1))
               for i in range(body.n)]
    return engine.submit_many(prompt, choices)


def _settings(app: FastAPI, body, prompt: list, allow_calls: bool) -> Settings:
    config, engine = app.state.config, app.state.engine
    fields = processor_fields(body, engine.model.args.text_config.vocab_size, allow_calls)
    processors = processors_from(fields, engine.tokenizer)
    if app.state.logits_processors is not None:
        processors += list(app.state.logits_processors(body, prompt))
    pick = lambda value, default: default if value is None else value  # noqa: E731
    return Settings(max_tokens=pick(body.token_limit(), config.max_tokens),
                    temp=pick(body.temperature, config.temp), top_p=pick(body.top_p, config.top_p),
                    min_p=pick(body.min_p, config.min_p), top_k=pick(body.top_k, config.top_k),
                    seed=body.seed, stops=body.stops(), logprobs=body.logprob_count(),
                    processors=processors, processor_fields=fields)


def _sse(events, jobs: list) -> StreamingResponse:
    async def guarded():
        try:
            async for text in events:
                yield text
        finally:  # the client went away (or the stream ended): stop the generation
            for job in jobs:
                if job.finish is None:
                    job.cancel()
    return StreamingResponse(guarded(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def _merged(streams: list, body, jobs: list, chat: Optional[out.ChatStream],
                  ids: tuple = ()):
    """The SSE events of one choice's stream (n = 1), or of several interleaved as their
    tokens come, then one usage chunk (when asked; `chat`'s, or a completion's with `ids` =
    (id, created, model)) and [DONE]."""
    if len(streams) == 1:
        async for text in streams[0]:
            yield text
        return
    events: asyncio.Queue = asyncio.Queue()

    async def pump(stream):
        try:
            async for text in stream:
                await events.put(text)
        finally:
            await events.put(None)

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        left = len(tasks)
        while left:
            text = await events.get()
            if text is None:
                left -= 1
            else:
                yield text
    finally:
        for task in tasks:
            task.cancel()
    if all(job.finish is not None for job in jobs):
        if body.stream_options and body.stream_options.include_usage:
            total = out.sum_usage([out.usage(job.finish) for job in jobs])
            yield out.sse(chat.usage_chunk(totals=total) if chat is not None else
                          out.completion_usage_chunk(*ids, total))
        yield out.SSE_DONE


async def _until_done(request: Request, jobs: list, result):
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


async def _gathered(results: list) -> dict:
    """One body from the bodies of each choice: their choices in order, usage summed."""
    bodies = await asyncio.gather(*results)
    if len(bodies) == 1:
        return bodies[0]
    body = dict(bodies[0])
    body["choices"] = [dict(b["choices"][0], index=i) for i, b in enumerate(bodies)]
    body["usage"] = out.sum_usage([b["usage"] for b in bodies])
    return body


async def _collect(job) -> tuple:
    tokens, finish = [], None
    async for event in job.events():
        if isinstance(event, Token):
            tokens.append(event)
        else:
            finish = event
    return tokens, finish


async def _chat_result(app: FastAPI, job, thinking: bool):
    tokens, finish = await _collect(job)
    reply = parse_reply("".join(t.text for t in tokens) + finish.text, thinking)
    return out.chat_completion(app.state.config.model_id, reply, finish, tokens,
                               app.state.token_text)


async def _completion_result(app: FastAPI, job):
    tokens, finish = await _collect(job)
    return out.completion(app.state.config.model_id, tokens, finish, app.state.token_text)


async def _chat_stream(app: FastAPI, body: ChatCompletionRequest, job, thinking: bool,
                       stream: out.ChatStream, last: bool = True):
    """One choice's chunks; with `last`, then the usage chunk (when asked) and [DONE]."""
    parser, reply, pending = ReplyParser(thinking), Reply(), []
    yield out.sse(stream.chunk({"role": "assistant", "content": ""}))
    try:
        async for event in job.events():
            deltas = parser.feed(event.text)
            if isinstance(event, Token):
                pending.append(event)
            else:
                deltas += parser.finish()
            for d in deltas:
                reply.add([d])
                yield out.sse(stream.chunk(stream.delta(d), tokens=pending))
                pending = []
    except Exception as e:  # after the headers went out: the error is the stream's last event
        log.warning("streamed request failed: %s", e)
        yield out.sse(out.error_body(f"internal error: {type(e).__name__}: {e}",
                                     kind="server_error"))
        return
    finish = job.finish
    yield out.sse(stream.chunk({}, out.finish_reason(finish, bool(reply.calls)), pending))
    if last:
        if body.stream_options and body.stream_options.include_usage:
            yield out.sse(stream.usage_chunk(finish))
        yield out.SSE_DONE


async def _completion_stream(app: FastAPI, body: CompletionRequest, job, cid: str,
                             created: int, index: int = 0, last: bool = True):
    """One choice's chunks; with `last`, then the usage chunk (when asked) and [DONE]."""
    model_id, offset, token_text = app.state.config.model_id, 0, app.state.token_text
    try:
        async for event in job.events():
            tokens = [event] if isinstance(event, Token) else []
            reason = None if tokens else out.finish_reason(event)
            yield out.sse(out.completion_chunk(cid, created, model_id, event.text,
                                               token_text.completion_logprobs(tokens, offset),
                                               reason, index))
            offset += len(event.text)
    except Exception as e:
        log.warning("streamed request failed: %s", e)
        yield out.sse(out.error_body(f"internal error: {type(e).__name__}: {e}",
                                     kind="server_error"))
        return
    if last:
        if body.stream_options and body.stream_options.include_usage:
            yield out.sse(out.completion_usage_chunk(cid, created, model_id,
                                                     out.usage(job.finish)))
        yield out.SSE_DONE
