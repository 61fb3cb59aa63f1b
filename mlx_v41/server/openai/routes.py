"""OpenAI's chat completions and completions: `POST /v1/chat/completions` and
`POST /v1/completions`. Routes validate, render the prompt (image placeholders expanded into
their spans) and hand it to the engine; a client that goes away cancels its request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional, Union

from fastapi import FastAPI, Request

from ...model.vision.prompt import ImagePrompt
from ..conversation import thinking_mode, with_response_format
from ..engine import Token
from ..bodies import documented, json_body
from ..errors import ErrorBody, RequestError, error_body
from ..images import ImageReader
from ..processors import processor_fields
from ..reply_parser import Reply, ReplyParser, parse_reply
from ..serving import (chat_prompt, collect, expanded_prompt, failure, read_json, sse_response,
                       submit, until_done)
from . import bodies as out
from .messages import allows_tool_calls, chat_messages, request_constraint
from .protocol import (ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, Completion,
                       CompletionChunk, CompletionRequest, parse_body)

log = logging.getLogger("mlx_v41.server")


def add_routes(app: FastAPI) -> None:
    app.state.token_text = out.TokenText(app.state.engine.tokenizer)

    @app.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest),
              responses=documented(ChatCompletion, ErrorBody, done=True,
                                   events=Union[ChatCompletionChunk, ErrorBody]))
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

    @app.post("/v1/completions", openapi_extra=json_body(CompletionRequest),
              responses=documented(Completion, ErrorBody, done=True,
                                   events=Union[CompletionChunk, ErrorBody]))
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



def _chat_prompt(app: FastAPI, body: ChatCompletionRequest) -> tuple:
    """(`ImagePrompt`, thinking mode, whether tool calls may be generated)."""
    config, engine = app.state.config, app.state.engine
    images = ImageReader.for_model(engine.model, config.max_image_bytes, config.max_image_pixels)
    messages = with_response_format(chat_messages(body, config.system_prompt, images),
                                    body.response_format)
    thinking, effort = thinking_mode(body, config.thinking, config.reasoning_effort)
    allow_calls = allows_tool_calls(body)
    specs = [tool.model_dump(exclude_none=True)["function"] for tool in body.tools or ()]
    prompt = chat_prompt(app, messages, specs, thinking=thinking, effort=effort,
                         param="messages", hint=": use /v1/completions", continue_final=False)
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
    chat = isinstance(body, ChatCompletionRequest)
    fields = processor_fields(body, app.state.engine.model.args.text_config.vocab_size,
                              allow_calls, chat=chat)
    fields["constraint"] = constraint
    settings = app.state.config.settings(
        max_tokens=body.token_limit(), temp=body.temperature, top_p=body.top_p,
        min_p=body.min_p, top_k=body.top_k, seed=body.seed, stops=body.stops(),
        logprobs=body.logprob_count(), processor_fields=fields)
    return submit(app, prompt, settings, n=body.n, param="messages" if chat else "prompt",
                  body=body)


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
    reply = parse_reply("".join(t.text for t in tokens) + finish.text, thinking,
                        cut=finish.reason == "length")
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
                deltas += parser.finish(cut=event.reason == "length")
            for d in deltas:
                reply.add([d])
                if d.kind == "cut":  # its deltas went out: the finish, "length", tells
                    continue
                yield out.sse(stream.chunk(stream.delta(d), tokens=pending))
                pending = []
    except Exception as e:  # after the headers went out: the error is the stream's last event
        log.warning("streamed request failed: %s", e)
        yield _failed(e, last)
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
        yield _failed(e, last)
        return
    if last:
        if body.stream_options and body.stream_options.include_usage:
            yield out.sse(out.completion_usage_chunk(cid, created, model_id,
                                                     out.usage(job.finish)))
        yield out.SSE_DONE


def _failed(error: Exception, last: bool) -> str:
    """A stream's last events after a failure: the error in OpenAI's shape, then [DONE] (when
    this is the last choice's stream), so a client's SSE reader ends cleanly."""
    f = failure(error)
    return out.sse(error_body(f.message, kind=f.kind, code=f.code)) + \
        (out.SSE_DONE if last else "")
