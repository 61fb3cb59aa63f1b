"""OpenAI's Responses API: `POST /v1/responses` (streamed as its typed events or not),
`GET` and `DELETE /v1/responses/{id}`. A request is rendered as a chat conversation (its
`previous_response_id`'s stored conversation, then its own input items) and served by the
engine like a chat completion; a completed response is stored for the next turn.
"""

from __future__ import annotations

import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ..bodies import ERROR_STATUSES, documented, json_body
from ..constraints import constraint_fields
from ..conversation import with_response_format
from ..engine import Settings, Token
from ..errors import ErrorBody, RequestError, error_body
from ..images import ImageReader
from ..processors import base_fields
from ..reply_parser import ReplyParser
from .events import ResponseBuilder, sse
from .protocol import (Conversation, DeletedResponse, Response, ResponseEvent, ResponsesRequest,
                       answer_format, check_supported, function_tools, input_items,
                       parse_request, reasoning_mode, tool_choice, tool_spec)
from .store import DEFAULT_MAX_STORED_RESPONSES, ResponseStore, StoredResponse
from ..serving import (chat_prompt, failure, new_id, read_json, sse_response, submit,
                       until_done)

log = logging.getLogger("mlx_v41.server")
PARAMS = {"tools": "tools", "tool_choice": "tool_choice", "format": "text.format.schema"}
RESPONSE_ID = {"parameters": [{"name": "response_id", "in": "path", "required": True,
                               "schema": {"type": "string"}}]}
# the stored responses' routes queue nothing: they are never busy
STORE_STATUSES = {status: why for status, why in ERROR_STATUSES.items()
                  if status in (401, 404, 500)}


def add_routes(app: FastAPI) -> None:
    """Register this API's routes on the app, with a store of the default size (the CLI
    replaces `app.state.responses` with one of `--max-stored-responses`)."""
    app.state.responses = ResponseStore(DEFAULT_MAX_STORED_RESPONSES)

    @app.post("/v1/responses", openapi_extra=json_body(ResponsesRequest),
              responses=documented(Response, ErrorBody, events=ResponseEvent))
    async def create(request: Request):
        body = parse_request(await read_json(request))
        app.state.config.check_model(body.model)
        check_supported(body)
        turn = _Turn(app, body)
        jobs = submit(app, turn.prompt, turn.settings, param="input", body=body)
        run = _run(app, turn, jobs[0])
        if body.stream:
            return sse_response(_streamed(run, turn.builder), jobs)
        try:
            return await until_done(request, jobs, _collected(run, turn.builder))
        except Exception as e:  # answered here: uvicorn closes the connection of an app error
            f = failure(e)
            if f.status == 500:
                log.exception("request failed")
            return JSONResponse(error_body(f.message, kind=f.kind, code=f.code),
                                status_code=f.status)

    # the id is read from the path, not a typed parameter, so the schema declares no 422
    @app.get("/v1/responses/{response_id}", openapi_extra=RESPONSE_ID,
             responses=documented(Response, ErrorBody, statuses=STORE_STATUSES))
    async def retrieve(request: Request):
        response_id = request.path_params["response_id"]
        stored = app.state.responses.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        return stored.body

    @app.delete("/v1/responses/{response_id}", openapi_extra=RESPONSE_ID,
                responses=documented(DeletedResponse, ErrorBody, statuses=STORE_STATUSES))
    async def delete(request: Request):
        response_id = request.path_params["response_id"]
        if not app.state.responses.delete(response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


def _not_found(response_id: str) -> RequestError:
    return RequestError(f"no response with id {response_id!r} is stored", status=404,
                        param="response_id", code="not_found")


class _Turn:
    """One request made ready to run: its conversation items, rendered prompt, settings and
    the response it builds."""

    def __init__(self, app: FastAPI, body: ResponsesRequest):
        config, tokenizer = app.state.config, app.state.engine.tokenizer
        self.body, history, new = body, self._history(app, body), input_items(body)
        self.thinking, effort = reasoning_mode(body, config.thinking, config.reasoning_effort)
        messages = self._messages(app, history, new)
        tools = function_tools(body)
        specs = [tool_spec(tool) for tool in tools]
        calls, named = tool_choice(body)
        constraint = constraint_fields(tokenizer, tools=specs, calls=calls, named=named,
                                       answer=answer_format(body), thinking=self.thinking,
                                       parallel=body.parallel_tool_calls, params=PARAMS)
        self.prompt = self._render(app, messages, specs, effort)
        self.items = history + new  # the conversation so far, as input items
        self.settings = config.settings(max_tokens=body.max_output_tokens, temp=body.temperature,
                                        top_p=body.top_p, seed=body.seed,
                                        processor_fields=base_fields(calls != "none", constraint))
        self.builder = ResponseBuilder(_body(config, body, tools, self.settings))

    @staticmethod
    def _history(app: FastAPI, body: ResponsesRequest) -> list:
        if body.previous_response_id is None:
            return []
        stored = app.state.responses.get(body.previous_response_id)
        if stored is None:
            raise RequestError(f"previous response with id {body.previous_response_id!r} "
                               "not found", param="previous_response_id",
                               code="previous_response_not_found")
        return list(stored.items)

    def _messages(self, app: FastAPI, history: list, new: list) -> list:
        config, engine = app.state.config, app.state.engine
        conversation = Conversation(ImageReader.for_model(engine.model, config.max_image_bytes,
                                                          config.max_image_pixels))
        for item in history:  # stored, so checked when they were new
            conversation.add(item, "previous_response_id")
        for k, item in enumerate(new):
            conversation.add(item, "input" if isinstance(self.body.input, str) else f"input[{k}]")
        messages = conversation.messages
        if not messages:
            raise RequestError("input: no input items", param="input")
        if self.body.instructions is not None:
            messages.insert(0, {"role": "system", "content": self.body.instructions})
        elif config.system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": config.system_prompt})
        text = self.body.text
        text_format = text and text.format.model_dump(by_alias=True, exclude_none=True)
        return with_response_format(messages, text_format)

    def _render(self, app: FastAPI, messages: list, specs: list, effort):
        return chat_prompt(app, messages, specs, thinking=self.thinking, effort=effort,
                           param="input", hint=": use /v1/completions", continue_final=False)


def _body(config, body: ResponsesRequest, tools: list, settings: Settings) -> dict:
    """The response object before its output: the request's settings echoed."""
    text = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text \
        else {"type": "text"}
    return {"id": new_id("resp_"), "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "background": False, "error": None,
            "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {},
            "model": config.model_id, "output": [],
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None,
                          "summary": None},
            "store": body.store, "temperature": settings.temp,
            "text": {"format": text}, "tool_choice": body.tool_choice or "auto",
            "tools": [tool.model_dump() for tool in tools],
            "top_p": settings.top_p, "truncation": "disabled",
            "usage": None, "user": body.user}


async def _run(app: FastAPI, turn: _Turn, job):
    """The response's events as its reply streams; a response that completed or reached
    `max_output_tokens` is then stored (with `store`)."""
    builder, parser = turn.builder, ReplyParser(turn.thinking)
    for event in builder.start():
        yield event
    async for event in job.events():
        if isinstance(event, Token):
            builder.reasoning_tokens += parser.phase == "reasoning"
            deltas = parser.feed(event.text)
        else:
            deltas = parser.feed(event.text) + parser.finish(cut=event.reason == "length")
        for delta in deltas:
            for out in builder.add(delta):
                yield out
    for out in builder.finish(job.finish):
        yield out
    if turn.body.store and builder.body["status"] in ("completed", "incomplete"):
        items = turn.items + [dict(item) for item in builder.body["output"]]
        app.state.responses.put(builder.body["id"], StoredResponse(builder.body, items))


async def _collected(run, builder: ResponseBuilder) -> dict:
    async for _ in run:
        pass
    return builder.body


async def _streamed(run, builder: ResponseBuilder):
    try:
        async for event in run:
            yield sse(event)
    except Exception as e:  # after the headers went out: the error ends the stream
        log.warning("streamed request failed: %s", e)
        for event in builder.fail(failure(e).message):
            yield sse(event)
