"""Anthropic's Messages API: `POST /v1/messages` (streamed as Anthropic's named SSE events or
not) and `POST /v1/messages/count_tokens`. The request is rendered with V4.1's chat format,
its reply split by `ReplyParser` into thinking, text and tool_use content blocks; errors come
back in Anthropic's shape (`error_body`, also used by app.py's handlers for these paths).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Optional

from fastapi import FastAPI, Request

from ...model.vision.prompt import ImagePrompt
from . import protocol as ap
from ..bodies import ERROR_STATUSES, documented, json_body
from ..constraints import constraint_fields
from ..conversation import with_response_format
from ..engine import Finish, Token
from ..images import ImageReader
from ..processors import base_fields
from ..reply_parser import Delta, ReplyParser
from ..serving import (chat_prompt, collect, failure, new_id, read_json, sse_response, submit,
                       until_done)

log = logging.getLogger("mlx_v41.server")

PATH = "/v1/messages"  # this API's routes (and its error shape) live under it
# HTTP status -> Anthropic's error type; other 4xx are invalid_request_error, 5xx api_error
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
               529: "overloaded_error"}


# count_tokens queues nothing: it is never busy, and it answers while the server shuts down
COUNT_STATUSES = {status: why for status, why in ERROR_STATUSES.items() if status not in (429, 503)}


def error_body(status: int, message: str, details: Optional[dict] = None) -> dict:
    """Anthropic's error body; `details` (its `error_code` and more) where the error has
    them."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    error = {"type": kind, "message": message}
    return {"type": "error", "error": error if details is None else dict(error, details=details)}


def signature(thinking: str) -> str:
    """A thinking block's `signature`: the sha256 of its text (accepted back, never
    checked: the server keeps no secret)."""
    return hashlib.sha256(thinking.encode()).hexdigest()


@dataclass
class Rendered:
    """A request's prompt and how its reply is read."""

    prompt: ImagePrompt
    thinking: bool  # the reply opens with reasoning (thinking mode and no prefill)
    effort: object
    budget: Optional[int]
    tools: list  # function specs
    prefill: bool  # the last message is the assistant's: the reply continues it


def add_routes(app: FastAPI) -> None:
    """Register this API's routes on the app."""

    @app.post(PATH, openapi_extra=json_body(ap.MessagesRequest),
              responses=documented(ap.AnthropicMessage, ap.AnthropicError,
                                   events=ap.StreamEvent))
    async def messages(request: Request):
        body = ap.parse_request(ap.MessagesRequest, await read_json(request))
        app.state.config.check_model(body.model)
        rendered = render(app, body)
        job = _submit(app, body, rendered)
        reply = _Reply(app, rendered, job)
        if body.stream:
            return sse_response(reply.events(), [job], keepalive=PING, is_after_first=True)
        return await until_done(request, [job], reply.message())

    @app.post(PATH + "/count_tokens", openapi_extra=json_body(ap.CountTokensRequest),
              responses=documented(ap.TokenCount, ap.AnthropicError, statuses=COUNT_STATUSES))
    async def count_tokens(request: Request):
        body = ap.parse_request(ap.CountTokensRequest, await read_json(request))
        app.state.config.check_model(body.model)
        return {"input_tokens": len(render(app, body).prompt.ids)}


def render(app: FastAPI, body: ap.CountTokensRequest) -> Rendered:
    """The request's prompt, rendered as openai/routes.py renders a chat completion's."""
    config, engine = app.state.config, app.state.engine
    images = ImageReader.for_model(engine.model, config.max_image_bytes, config.max_image_pixels)
    messages = with_response_format(ap.chat_messages(body, config.system_prompt, images),
                                    body.output_config and body.output_config.format)
    thinking, effort, budget = ap.thinking_mode(body, config.thinking, config.reasoning_effort)
    tools = ap.function_specs(body)
    prompt = chat_prompt(app, messages, tools, thinking=thinking, effort=effort,
                         param="messages")
    prefill = messages[-1]["role"] == "assistant"
    return Rendered(prompt, thinking and not prefill, effort, budget if thinking else None,
                    tools, prefill)


def _submit(app: FastAPI, body: ap.MessagesRequest, rendered: Rendered):
    use = ap.tool_use(body)
    budget = None if rendered.prefill else rendered.budget
    constraint = constraint_fields(
        app.state.engine.tokenizer, tools=rendered.tools, calls=use.calls, named=use.named,
        answer=ap.answer_schema(body), thinking=rendered.thinking, parallel=use.parallel,
        reasoning_budget=budget, params={"tools": "tools", "tool_choice": "tool_choice",
                                         "format": "output_config.format"})
    settings = app.state.config.settings(
        max_tokens=body.max_tokens, temp=body.temperature, top_p=body.top_p, top_k=body.top_k,
        seed=body.seed, stops=list(body.stop_sequences or ()),
        processor_fields=base_fields(use.allow_calls, constraint=constraint,
                                     reasoning_budget=budget))
    [job] = submit(app, rendered.prompt, settings, param="messages", body=body)
    return job


# ----------------------------------------------------------------------------- replies

def usage(finish: Finish) -> dict:
    """Anthropic's usage: `input_tokens` are the prompt tokens read anew, the rest were the
    prompt cache's; the server writes its caches itself, so nothing counts as creation."""
    return {"input_tokens": finish.prompt_tokens - finish.cached_tokens,
            "output_tokens": finish.completion_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": finish.cached_tokens}


class _Reply:
    """One request's reply: the whole message, or its stream of events."""

    def __init__(self, app: FastAPI, rendered: Rendered, job):
        self.job, self.rendered = job, rendered
        self.model, self.id = app.state.config.model_id, new_id("msg_")

    def shell(self, content: list, stop: tuple, usage_: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop[0], "stop_sequence": stop[1],
                "usage": usage_}

    async def message(self) -> dict:
        tokens, finish = await collect(self.job)
        parser, blocks = ReplyParser(self.rendered.thinking), BlockStream()
        text = "".join(t.text for t in tokens) + finish.text
        for d in parser.feed(text) + parser.finish(cut=finish.reason == "length"):
            blocks.feed(d)
        blocks.close()
        return self.shell(blocks.content, self.stop(finish, blocks.calls > 0),
                          usage(finish))

    @staticmethod
    def stop(finish: Finish, has_calls: bool) -> tuple:
        """(stop_reason, stop_sequence)."""
        if finish.reason == "length":
            return "max_tokens", None
        if finish.stop_sequence is not None:
            return "stop_sequence", finish.stop_sequence
        return ("tool_use" if has_calls else "end_turn"), None

    async def events(self):
        """Anthropic's event stream; an error once it started is its last event."""
        start = self.shell([], (None, None), {"input_tokens": len(self.rendered.prompt.ids),
                                              "output_tokens": 0,
                                              "cache_creation_input_tokens": 0,
                                              "cache_read_input_tokens": 0})
        yield sse("message_start", {"type": "message_start", "message": start})
        yield sse("ping", {"type": "ping"})
        parser, blocks = ReplyParser(self.rendered.thinking), BlockStream()
        try:
            async for event in self.job.events():
                deltas = parser.feed(event.text)
                if not isinstance(event, Token):
                    deltas += parser.finish(cut=event.reason == "length")
                for d in deltas:
                    for text in blocks.feed(d):
                        yield text
        except Exception as e:  # after the headers went out: the error is the last event
            log.warning("streamed request failed: %s", e)
            f = failure(e)
            yield sse("error", error_body(f.status, f.message))
            return
        for text in blocks.close():
            yield text
        finish = self.job.finish
        reason, sequence = self.stop(finish, blocks.calls > 0)
        yield sse("message_delta", {"type": "message_delta", "delta": {
            "stop_reason": reason, "stop_sequence": sequence}, "usage": usage(finish)})
        yield sse("message_stop", {"type": "message_stop"})


def sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


PING = sse("ping", {"type": "ping"})  # Anthropic's keepalive event


class BlockStream:
    """Reply deltas as content blocks, in their order: a block opens when the kind of delta
    changes (thinking, text, each tool_use) and closes before the next (a thinking block
    with its `signature_delta`). `feed` and `close` return the stream's events; `content`
    is the whole message's blocks so far (a tool_use cut off by max_tokens is stopped and
    dropped from it: its input never closed)."""

    KINDS = {"reasoning": "thinking", "content": "text"}

    def __init__(self):
        self.content, self.kind, self.calls, self.arguments = [], None, 0, ""

    def feed(self, d: Delta) -> list:
        if d.kind == "cut":
            stop = sse("content_block_stop", {"type": "content_block_stop",
                                              "index": len(self.content) - 1})
            self.content.pop()
            self.kind, self.arguments, self.calls = None, "", self.calls - 1
            return [stop]
        if d.kind == "arguments":
            self.arguments += d.text
            return [self._delta({"type": "input_json_delta", "partial_json": d.text})]
        if d.kind == "call":
            self.calls += 1
            return self._open("tool_use", {"type": "tool_use", "id": new_id("toolu_"),
                                           "name": d.text, "input": {}})
        kind = self.KINDS[d.kind]
        out = [] if self.kind == kind else self._open(
            kind, {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
            else {"type": "text", "text": ""})
        self.content[-1][kind] += d.text
        delta = {"type": f"{kind}_delta", kind: d.text}
        return out + [self._delta(delta)]

    def close(self) -> list:
        if self.kind is None:
            return []
        out, block = [], self.content[-1]
        if self.kind == "thinking":
            block["signature"] = signature(block["thinking"])
            out.append(self._delta({"type": "signature_delta",
                                    "signature": block["signature"]}))
        elif self.kind == "tool_use":  # the parser's arguments are one JSON object
            block["input"], self.arguments = json.loads(self.arguments or "{}"), ""
        self.kind = None
        return out + [sse("content_block_stop", {"type": "content_block_stop",
                                                 "index": len(self.content) - 1})]

    def _open(self, kind: str, block: dict) -> list:
        out = self.close()
        self.kind = kind
        self.content.append(block)
        return out + [sse("content_block_start", {"type": "content_block_start",
                                                  "index": len(self.content) - 1,
                                                  "content_block": dict(block)})]

    def _delta(self, delta: dict) -> str:
        return sse("content_block_delta", {"type": "content_block_delta",
                                           "index": len(self.content) - 1, "delta": delta})
