"""Ollama's chat and generate API in V4.1's terms: the bodies of `/api/chat`, `/api/generate`
and `/api/show` as pydantic models (errors name the field, `messages.0.images.1`), Ollama's
messages as `chat.format` dicts (base64 `images` as image blocks, `thinking` as reasoning,
`tool_calls` with object arguments), `think` as the thinking mode and effort, `format` as the
answer's constraint, `options` as sampling settings; and the reply bodies.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, Field

from ...generation.sequence import MAX_SEED
from ..bodies import (MIN_SEED, Int, ObjectSchema, StrictBody, check_tool_names,
                      parse, whole_number)
from ..constraints import JSON_OBJECT
from ..conversation import OPENAI_EFFORTS
from ..errors import RequestError
from ..images import ImageReader

ThinkLevel = Literal["low", "medium", "high", "max"]  # Ollama's levels; medium is V4.1's high
JSON_FORMAT = "json"  # `format: "json"`: the answer is a JSON object


# ----------------------------------------------------------------------------- requests

class Options(StrictBody):
    """`options`: the sampling ones below are honoured; Ollama's others (num_ctx, num_keep,
    repeat_penalty, mirostat, num_gpu, ...) are accepted and ignored."""

    temperature: Optional[float] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, ge=0, le=1)  # 0: the most likely token only
    top_k: Optional[Int] = None  # 0 or less: off
    min_p: Optional[float] = Field(None, ge=0, le=1)
    seed: Optional[whole_number(ge=MIN_SEED, le=MAX_SEED)] = None  # negative: random
    num_predict: Optional[Int] = None  # 0 or less (Ollama's "no limit"): --max-tokens
    stop: Union[str, list[str], None] = None


class CallFunction(StrictBody):
    name: str
    arguments: dict = {}
    index: Optional[Int] = None


class ToolCall(StrictBody):
    id: Optional[str] = None
    function: CallFunction


class Message(StrictBody):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: Optional[str] = None  # an assistant's reasoning, sent back
    images: Optional[list[str]] = None  # base64
    tool_calls: Optional[list[ToolCall]] = None
    tool_name: Optional[str] = None  # accepted: V4.1 matches results to calls by order or id
    tool_call_id: Optional[str] = None


class FunctionSpec(StrictBody):
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[ObjectSchema] = None


class Tool(StrictBody):
    type: Literal["function"] = "function"
    function: FunctionSpec


class _Request(StrictBody):
    """What chat and generate share."""

    model: str = Field(min_length=1)
    stream: Optional[bool] = True
    format: Union[Literal["", "json"], dict, None] = None
    options: Optional[Options] = None
    keep_alive: Union[str, float, None] = Field(
        None, description="accepted: the model stays loaded while the server runs")
    think: Union[bool, ThinkLevel, None] = None
    logprobs: Optional[bool] = Field(False, description="not supported: true is a 400")


class ChatRequest(_Request):
    """`POST /api/chat`; no messages: the model is loaded (it always is)."""

    messages: list[Message] = []
    tools: Optional[list[Tool]] = None

    @property
    def is_load(self) -> bool:
        return not self.messages


class GenerateRequest(_Request):
    """`POST /api/generate`; an empty prompt: the model is loaded (it always is)."""

    prompt: str = ""
    system: Optional[str] = None
    raw: Optional[bool] = False
    images: Optional[list[str]] = None  # base64
    suffix: Optional[str] = Field(None, description="not supported: a suffix is a 400")
    template: Optional[str] = Field(None, description="not supported: a template is a 400")
    context: Optional[list[Int]] = Field(None, description="not supported: a context is a "
                                         "400 (send a conversation to /api/chat)")

    @property
    def is_load(self) -> bool:
        return not self.prompt


class ShowRequest(StrictBody):
    """`POST /api/show`; `name` is the field's name in older clients."""

    model: Optional[str] = None
    name: Optional[str] = None
    verbose: Optional[bool] = False


def parse_request(model_class, body):
    """Validate a decoded JSON body; RequestError naming the field at fault."""
    request = parse(model_class, body, dotted=True)
    if isinstance(request, ShowRequest):
        if not (request.model or request.name):
            raise RequestError("model: Field required", param="model")
        return request
    if request.logprobs:
        raise RequestError("logprobs: not supported by this server", param="logprobs")
    if isinstance(request, ChatRequest):
        check_tool_names([tool.function.name for tool in request.tools or ()],
                         lambda k: f"tools.{k}.function.name")
    else:
        _check_generate(request)
    return request


def _check_generate(request: GenerateRequest) -> None:
    for name, why in (("suffix", "fill-in-the-middle is not supported by V4.1's chat format"),
                      ("template", "prompt templates are not supported: V4.1's chat format "
                                   "renders the prompt (or send `raw`)"),
                      ("context", "a context is not supported: send the conversation to "
                                  "/api/chat")):
        if getattr(request, name):
            raise RequestError(f"{name}: {why}", param=name)
    if request.raw and (request.system or request.images):
        name = "system" if request.system else "images"
        raise RequestError(f"{name}: not allowed with raw (the prompt is sent as it is)",
                           param=name)


# ----------------------------------------------------------------------------- conversion

def thinking_mode(think, default_thinking: bool, default_effort) -> tuple:
    """(thinking, reasoning effort): `think` absent is the server's mode, a level turns thinking
    on with that effort (Ollama's medium is V4.1's high)."""
    if think is None:
        return default_thinking, default_effort
    if isinstance(think, bool):
        return think, default_effort
    return True, OPENAI_EFFORTS.get(think, think)


def answer_format(form) -> tuple:
    """(answer for the constraint, response format for the system message) of `format`: "json"
    is any JSON object, an object a JSON schema, "" or absent free text."""
    if form is None or form == "":
        return None, None
    if form == JSON_FORMAT:
        return JSON_OBJECT, {"type": JSON_OBJECT}
    return form, {"type": "json_schema", "schema": form}


def sampling(options: Optional[Options]) -> dict:
    """`ServerConfig.settings` keywords from `options` (None: the server's value)."""
    o = options or Options()
    return {"max_tokens": o.num_predict if o.num_predict and o.num_predict > 0 else None,
            "temp": o.temperature, "top_p": o.top_p,
            "top_k": None if o.top_k is None else max(o.top_k, 0), "min_p": o.min_p,
            "seed": None if o.seed is None or o.seed < 0 else o.seed,
            "stops": [o.stop] if isinstance(o.stop, str) else list(o.stop or ())}


def function_specs(request: ChatRequest) -> list:
    """The request's tools as function specs `{"name", "description", "parameters"}`."""
    return [tool.function.model_dump(exclude_none=True) for tool in request.tools or ()]


def chat_messages(request: ChatRequest, system_prompt: Optional[str],
                  images: ImageReader) -> list:
    """The request's messages as `chat.format` dicts (`system_prompt` opens a conversation
    without a system message): images before the text, an assistant's `thinking` as its
    reasoning and its calls with their ids, a tool result with its call's id if given."""
    out = []
    for k, message in enumerate(request.messages):
        where = f"messages.{k}"
        entry = {"role": message.role, "content": with_images(
            message.content, message.images, message.role, f"{where}.images", images)}
        if message.thinking and message.role == "assistant":
            entry["reasoning_content"] = message.thinking
        if message.tool_calls and message.role == "assistant":
            entry["tool_calls"] = [{"id": call.id, "type": "function", "function": {
                "name": call.function.name, "arguments": call.function.arguments}}
                for call in message.tool_calls]
        if message.tool_call_id and message.role == "tool":
            entry["tool_call_id"] = message.tool_call_id
        out.append(entry)
    if system_prompt and out[0]["role"] != "system":
        out.insert(0, {"role": "system", "content": system_prompt})
    return out


def generate_messages(request: GenerateRequest, system_prompt: Optional[str],
                      images: ImageReader) -> list:
    """A generate request as a one-turn chat: `system` (else `system_prompt`), then the prompt
    with its images."""
    system = request.system or system_prompt
    user = {"role": "user", "content": with_images(request.prompt, request.images, "user",
                                                   "images", images)}
    return ([{"role": "system", "content": system}] if system else []) + [user]


def with_images(text: str, encoded: Optional[list], role: str, where: str,
                images: ImageReader):
    """`text`, or with base64 `encoded` images their image blocks and then the text."""
    if not encoded:
        return text
    blocks = [images.base64_block(data, role, f"{where}.{j}") for j, data in enumerate(encoded)]
    return blocks + ([{"type": "text", "text": text}] if text else [])


# ----------------------------------------------------------------------------- replies

DoneReason = Literal["stop", "length", "load"]


class OllamaError(BaseModel):
    """Ollama's error body (`routes.error_body`); a stream's last line when it fails."""

    error: str


class ReplyFunction(BaseModel):
    index: int
    name: str
    arguments: dict[str, Any]


class ReplyToolCall(BaseModel):
    id: str
    function: ReplyFunction


class ReplyMessage(BaseModel):
    role: Literal["assistant"]
    content: str
    thinking: Optional[str] = None
    tool_calls: Optional[list[ReplyToolCall]] = None


class _Done(BaseModel):
    """The fields of the last body (durations in nanoseconds)."""

    model: str
    created_at: str
    done: bool
    done_reason: Optional[DoneReason] = None
    total_duration: Optional[int] = None
    load_duration: Optional[int] = None
    prompt_eval_count: Optional[int] = None
    prompt_eval_duration: Optional[int] = None
    eval_count: Optional[int] = None
    eval_duration: Optional[int] = None


class ChatResponse(_Done):
    """A whole chat reply; streamed, one line a piece with `done` false, then the last."""

    message: ReplyMessage


class GenerateResponse(_Done):
    """A whole generate reply; streamed, one line a piece with `done` false, then the last."""

    response: str
    thinking: Optional[str] = None
