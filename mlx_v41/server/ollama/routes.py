"""Ollama's API: `POST /api/chat` and `POST /api/generate` (streamed as NDJSON lines, Ollama's
default, or not), `GET /api/tags`, `POST /api/show`, `GET /api/ps` and `GET /api/version`.
Requests are rendered with V4.1's chat format (or, generate's `raw`, sent as they are), their
replies split by `ReplyParser` into `thinking`, text and whole tool calls; errors come back
as Ollama's `{"error": "..."}` (`error_body`, also used by app.py's handlers for these paths).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Optional, Union

from fastapi import FastAPI, Request

from ...model.vision.prompt import ImagePrompt
from ..bodies import ERROR_STATUSES, documented, json_body, schema_of
from ..constraints import constraint_fields
from ..conversation import with_response_format
from ..engine import Token
from ..images import ImageReader
from ..processors import base_fields
from ..reply_parser import ReplyParser
from ..serving import (chat_prompt, expanded_prompt, failure, new_id, read_json, sse_response,
                       submit, until_done)
from . import models
from . import protocol as op

log = logging.getLogger("mlx_v41.server")

PATH = "/api/"  # this API's routes (and its error shape) live under it
NDJSON = "application/x-ndjson"  # a stream: one JSON body a line
NANOSECONDS = 10**9
# what a route that queues nothing may answer besides its reply, and a GET route
SHOW_STATUSES = {status: why for status, why in ERROR_STATUSES.items() if status != 429}
GET_STATUSES = {status: ERROR_STATUSES[status] for status in (401, 503)}


def error_body(message: str) -> dict:
    return {"error": message}


def _documented(reply) -> dict:
    """A generate or chat route's `responses`: `reply` as JSON, or its NDJSON lines."""
    responses = documented(reply, op.OllamaError)
    responses[200]["content"] = {NDJSON: {"itemSchema": schema_of(Union[reply,
                                                                        op.OllamaError])}}
    responses[200]["description"] = "the reply, or (`stream`, the default) its NDJSON lines"
    return responses


def add_routes(app: FastAPI) -> None:
    """Register this API's routes on the app."""
    loaded_at = datetime.now(timezone.utc)

    def description() -> models.Description:
        if not hasattr(app.state, "ollama_model"):
            app.state.ollama_model = models.describe(app.state.engine.model,
                                                     app.state.config.model_id, loaded_at)
        return app.state.ollama_model

    @app.post("/api/chat", openapi_extra=json_body(op.ChatRequest),
              responses=_documented(op.ChatResponse))
    async def chat(request: Request):
        return await _answer(app, request, op.ChatRequest, _render_chat)

    @app.post("/api/generate", openapi_extra=json_body(op.GenerateRequest),
              responses=_documented(op.GenerateResponse))
    async def generate(request: Request):
        return await _answer(app, request, op.GenerateRequest, _render_generate)

    @app.get("/api/tags", response_model=models.TagList,
             responses=documented(models.TagList, op.OllamaError, statuses=GET_STATUSES))
    async def tags():
        return {"models": [description().entry()]}

    @app.get("/api/ps", response_model=models.RunningList,
             responses=documented(models.RunningList, op.OllamaError, statuses=GET_STATUSES))
    async def ps():
        return {"models": [description().running()]}

    @app.post("/api/show", openapi_extra=json_body(op.ShowRequest),
              responses=documented(models.ShowResponse, op.OllamaError,
                                   statuses=SHOW_STATUSES))
    async def show(request: Request):
        body = op.parse_request(op.ShowRequest, await read_json(request))
        _check_model(app, body.model or body.name)
        about = description()
        return {"parameters": models.show_parameters(app.state.config),
                "details": about.details, "model_info": about.model_info,
                "capabilities": about.capabilities, "modified_at": about.modified_at}

    @app.get("/api/version", response_model=models.Version,
             responses=documented(models.Version, op.OllamaError, statuses=GET_STATUSES))
    async def version():
        return {"version": models.OLLAMA_VERSION}


def _check_model(app: FastAPI, name: str) -> None:
    app.state.config.check_model(models.plain_name(name))


# ----------------------------------------------------------------------------- prompts

@dataclass
class Rendered:
    """A request's prompt and how its reply is read."""

    prompt: ImagePrompt
    thinking: Optional[bool]  # the reply opens with reasoning; None: raw text, not parsed
    tools: list  # function specs
    answer: object  # `format` as the constraint's answer (None: free text)
    is_chat: bool  # a chat reply (`message`), else generate's (`response`)


def _render_chat(app: FastAPI, body: op.ChatRequest) -> Rendered:
    config = app.state.config
    messages = op.chat_messages(body, config.system_prompt, _images(app))
    return _render(app, body, messages, op.function_specs(body), "messages")


def _render_generate(app: FastAPI, body: op.GenerateRequest) -> Rendered:
    if body.raw:
        ids = app.state.engine.tokenizer.encode_prompt(body.prompt)
        return Rendered(expanded_prompt(app, ids, [], "prompt"), None, [],
                        op.answer_format(body.format)[0], False)
    messages = op.generate_messages(body, app.state.config.system_prompt, _images(app))
    return _render(app, body, messages, [], "prompt")


def _images(app: FastAPI) -> ImageReader:
    config = app.state.config
    return ImageReader.for_model(app.state.engine.model, config.max_image_bytes,
                                 config.max_image_pixels)


def _render(app: FastAPI, body, messages: list, tools: list, param: str) -> Rendered:
    """`messages` in V4.1's chat format (a last assistant message is continued, as Ollama
    does), with the answer format on the system message."""
    config = app.state.config
    answer, response_format = op.answer_format(body.format)
    messages = with_response_format(messages, response_format)
    thinking, effort = op.thinking_mode(body.think, config.thinking, config.reasoning_effort)
    prompt = chat_prompt(app, messages, tools, thinking=thinking, effort=effort, param=param,
                         hint=": send `raw` to /api/generate")
    prefill = messages[-1]["role"] == "assistant"
    return Rendered(prompt, thinking and not prefill, tools, answer,
                    isinstance(body, op.ChatRequest))


def _submit(app: FastAPI, body, rendered: Rendered):
    constraint = constraint_fields(
        app.state.engine.tokenizer, tools=rendered.tools, answer=rendered.answer,
        thinking=bool(rendered.thinking), params={"tools": "tools", "format": "format"})
    fields = base_fields(rendered.is_chat, constraint=constraint,
                         chat=rendered.thinking is not None)
    settings = app.state.config.settings(**op.sampling(body.options), processor_fields=fields)
    [job] = submit(app, rendered.prompt, settings, body=body,
                   param="messages" if rendered.is_chat else "prompt")
    return job


async def _answer(app: FastAPI, request: Request, model_class, render):
    """A chat or generate request's answer: `render(app, body)` gives its prompt; a request
    without messages or prompt only loads the model (it always is)."""
    started = time.perf_counter()
    body = op.parse_request(model_class, await read_json(request))
    _check_model(app, body.model)
    if body.is_load:
        return _Reply.loaded(body.model, is_chat=model_class is op.ChatRequest)
    rendered = render(app, body)
    reply = _Reply(body.model, rendered, _submit(app, body, rendered), started)
    if body.stream:
        return sse_response(reply.lines(), [reply.job], keepalive=reply.keepalive(),
                            media_type=NDJSON)
    return await until_done(request, [reply.job], reply.whole())


# ----------------------------------------------------------------------------- replies

def line(body: dict) -> str:
    return json.dumps(body, ensure_ascii=False) + "\n"


class Pieces:
    """A reply's text as Ollama's message fields, in order: `thinking` and `content` as they
    come (raw text, when `thinking` is None, all content), each tool call whole once its
    arguments closed (a call cut off by the token limit never closed: it is dropped)."""

    def __init__(self, thinking: Optional[bool]):
        self.parser = None if thinking is None else ReplyParser(thinking)
        self.calls: dict = {}  # index -> [name, its arguments' JSON so far]

    def feed(self, event) -> list:
        """The fields of each piece of `event` (a `Token` or the `Finish`)."""
        if self.parser is None:
            return [{"content": event.text}] if event.text else []
        deltas = self.parser.feed(event.text)
        if not isinstance(event, Token):
            deltas += self.parser.finish(cut=event.reason == "length")
        return [piece for d in deltas for piece in self._piece(d)]

    def _piece(self, d) -> list:
        if d.kind in ("reasoning", "content"):
            return [{"thinking" if d.kind == "reasoning" else "content": d.text}]
        if d.kind == "call":
            self.calls[d.index] = [d.text, ""]
            return []
        if d.kind == "cut":
            self.calls.pop(d.index, None)
            return []
        call = self.calls[d.index]
        call[1] += d.text
        if not d.closes:
            return []
        del self.calls[d.index]
        return [{"tool_calls": [{"id": new_id("call_"), "function": {
            "index": d.index, "name": call[0], "arguments": json.loads(call[1])}}]}]


class _Reply:
    """One request's reply: the whole body, or its NDJSON lines; timed as Ollama times it
    (nanoseconds: the prompt from the job's queueing to its first token, then the tokens)."""

    def __init__(self, model: str, rendered: Rendered, job, started: float):
        self.model, self.is_chat, self.job, self.started = model, rendered.is_chat, job, started
        self.pieces, self.first = Pieces(rendered.thinking), None

    @staticmethod
    def loaded(model: str, is_chat: bool) -> dict:
        """The answer to a request that only loads the model (it always is)."""
        return _body(model, is_chat, {}, done_reason="load")

    def keepalive(self) -> str:
        """An empty piece: what a stream sends while nothing else comes."""
        return line(_body(self.model, self.is_chat, {}))

    def _see(self, event) -> None:
        if self.first is None and isinstance(event, Token):
            self.first = time.perf_counter()

    def _end(self, finish) -> dict:
        now = time.perf_counter()
        first = self.first or now
        return {"done_reason": "length" if finish.reason == "length" else "stop",
                "total_duration": _ns(now - self.started), "load_duration": 0,
                "prompt_eval_count": finish.prompt_tokens,
                "prompt_eval_duration": _ns(first - self.job.submitted),
                "eval_count": finish.completion_tokens, "eval_duration": _ns(now - first)}

    async def whole(self) -> dict:
        fields: dict = {"content": "", "thinking": "", "tool_calls": []}
        finish = None
        async for event in self.job.events():
            self._see(event)
            for piece in self.pieces.feed(event):
                for key, value in piece.items():
                    fields[key] += value
            finish = event if not isinstance(event, Token) else finish
        return _body(self.model, self.is_chat, fields, **self._end(finish))

    async def lines(self):
        """The NDJSON lines; an error once they started is the last line."""
        finish = None
        try:
            async for event in self.job.events():
                self._see(event)
                for piece in self.pieces.feed(event):
                    yield line(_body(self.model, self.is_chat, piece))
                finish = event if not isinstance(event, Token) else finish
        except Exception as e:  # after the headers went out: the error is the last line
            log.warning("streamed request failed: %s", e)
            yield line(error_body(failure(e).message))
            return
        yield line(_body(self.model, self.is_chat, {}, **self._end(finish)))


def _body(model: str, is_chat: bool, fields: dict, **end) -> dict:
    """A chat or generate body of `fields` (content, thinking, tool_calls); with `end` (the
    done reason and the counts) the last one."""
    body: dict = {"model": model, "created_at": models.timestamp()}
    extra = {key: fields[key] for key in ("thinking", "tool_calls") if fields.get(key)}
    if is_chat:
        body["message"] = {"role": "assistant", "content": fields.get("content", ""), **extra}
    else:
        body.update(response=fields.get("content", ""), **extra)
    body["done"] = bool(end)
    return {**body, **end}


def _ns(seconds: float) -> int:
    return max(int(seconds * NANOSECONDS), 0)
