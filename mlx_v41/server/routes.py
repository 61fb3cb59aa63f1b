"""The FastAPI app: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`,
`GET /health`. Routes validate, render the prompt (image placeholders expanded into their
spans) and hand it to the engine; errors come back in OpenAI's JSON shape; a client that goes
away cancels its request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from typing import Callable, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ..chat import format as cf
from ..model.vision.prompt import ImagePrompt
from .engine import Engine, EngineBusy, EngineClosed, Token
from .images import ImageReader
from .messages import (allows_tool_calls, chat_messages, request_constraint, thinking_mode,
                       with_response_format)
from .processors import processor_fields
from .protocol import (ChatCompletionRequest, CompletionRequest, RequestError,
                       parse_body)
from .reply_parser import Reply, ReplyParser, parse_reply
from .serving import (ServerConfig, collect,
                      expanded_prompt, read_json, sse_response, submit, until_done)
from . import anthropic_messages, openai_responses
from . import responses as out

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
    app.state.token_text = out.TokenText(engine.tokenizer)
    _add_error_handlers(app)
    _add_routes(app)
    return app


def _error(status: int, message: str, **fields) -> JSONResponse:
    return JSONResponse(out.error_body(message, **fields), status_code=status)


def _add_error_handlers(app: FastAPI) -> None:
    def error(request, status: int, message: str, **fields) -> JSONResponse:
        """OpenAI's error shape, or Anthropic's under its Messages API's paths."""
        if request.url.path.startswith(anthropic_messages.PATH):
            return JSONResponse(anthropic_messages.error_body(status, message),
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

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = parse_body(ChatCompletionRequest, await read_json(request))
        app.state.config.check_model(body.model)
        prompt, thinking, allow_calls = _chat_prompt(app, body)
        constraint = request_constraint(body, app.state.engine.tokenizer, thinking)
        jobs = _submit(app, body, prompt, allow_calls, constraint)
        if body.stream:
            stream = out.ChatStream(app.state.config.model_id, app.state.token_text)
            return sse_response(_merged([_chat_stream(app, body, job, thinking, stream.choice(i),
                                              len(jobs) == 1)
                                 for i, job in enumerate(jobs)], body, jobs, stream), jobs)
        return await until_done(request, jobs, _gathered(
            [_chat_result(app, job, thinking) for job in jobs]))

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = parse_body(CompletionRequest, await read_json(request))
        app.state.config.check_model(body.model)
        jobs = _submit(app, body, _completion_prompt(app, body), True)
        if body.stream:
            cid, created = out.new_id("cmpl-"), int(time.time())
            return sse_response(_merged([_completion_stream(app, body, job, cid, created, i,
                                                    len(jobs) == 1)
                                 for i, job in enumerate(jobs)], body, jobs, None,
                                (cid, created, app.state.config.model_id)), jobs)
        return await until_done(request, jobs, _gathered(
            [_completion_result(app, job) for job in jobs]))

    anthropic_messages.add_routes(app)
    openai_responses.add_routes(app)


def _chat_prompt(app: FastAPI, body: ChatCompletionRequest) -> tuple:
    """(`ImagePrompt`, thinking mode, whether tool calls may be generated)."""
    config, engine = app.state.config, app.state.engine
    tokenizer = engine.tokenizer
    images = ImageReader.for_model(engine.model, config.max_image_bytes, config.max_image_pixels)
    messages = with_response_format(chat_messages(body, config.system_prompt, images),
                                    body.response_format)
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
    prompt = expanded_prompt(app, prompt, cf.collect_images(messages), "messages")
    return prompt, thinking, allow_calls


def _completion_prompt(app: FastAPI, body: CompletionRequest) -> ImagePrompt:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise RequestError("one prompt per request (a list of prompts is not supported)",
                               param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return expanded_prompt(app, app.state.engine.tokenizer.encode_prompt(prompt), [], "prompt")
    if not prompt:
        raise RequestError("prompt is empty", param="prompt")
    vocab = app.state.engine.model.args.text_config.vocab_size
    if not all(0 <= t < vocab for t in prompt):
        raise RequestError(f"prompt token ids must lie in 0..{vocab - 1}", param="prompt")
    return expanded_prompt(app, list(prompt), [], "prompt")


def _submit(app: FastAPI, body, prompt: ImagePrompt, allow_calls: bool,
            constraint: Optional[dict] = None):
    """An OpenAI chat completion's or completion's jobs (one per choice)."""
    param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    fields = processor_fields(body, app.state.engine.model.args.text_config.vocab_size,
                              allow_calls)
    fields["constraint"] = constraint
    settings = app.state.config.settings(
        max_tokens=body.token_limit(), temp=body.temperature, top_p=body.top_p,
        min_p=body.min_p, top_k=body.top_k, seed=body.seed, stops=body.stops(),
        logprobs=body.logprob_count(), processor_fields=fields)
    return submit(app, prompt, settings, n=body.n, param=param, body=body)


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


async def _gathered(results: list) -> dict:
    """One body from the bodies of each choice: their choices in order, usage summed."""
    bodies = await asyncio.gather(*results)
    if len(bodies) == 1:
        return bodies[0]
    body = dict(bodies[0])
    body["choices"] = [dict(b["choices"][0], index=i) for i, b in enumerate(bodies)]
    body["usage"] = out.sum_usage([b["usage"] for b in bodies])
    return body


async def _chat_result(app: FastAPI, job, thinking: bool):
    tokens, finish = await collect(job)
    reply = parse_reply("".join(t.text for t in tokens) + finish.text, thinking)
    return out.chat_completion(app.state.config.model_id, reply, finish, tokens,
                               app.state.token_text)


async def _completion_result(app: FastAPI, job):
    tokens, finish = await collect(job)
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
