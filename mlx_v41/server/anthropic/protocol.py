"""Anthropic's Messages API in V4.1's terms: request and reply bodies as pydantic models (errors
name the field as Anthropic does, `messages.3.content.0.tool_use_id`), content blocks as
`chat.format` message dicts, tools as function specs, `thinking` / `output_config.effort` as
the thinking mode and reasoning effort, `tool_choice` as the constraint's terms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, Field

from ..bodies import (ANTHROPIC_TOOL_NAME, ContentPart, Seed, StrictBody, check_tool_names, parse,
                      whole_number)
from ..errors import RequestError
from ..images import ImageReader

# thinking.budget_tokens below each bound takes that effort, a larger one "max" (V4.1's
# low = 50, high = 75, max = 100): Claude Code's "think" (4,000) is low, "think hard"
# (10,000) high, "ultrathink" (31,999) max.
BUDGET_EFFORTS = ((4096, "low"), (16384, "high"))
LARGEST_BUDGET_EFFORT = "max"
# output_config.effort on V4.1's scale
ANTHROPIC_EFFORTS = {"low": "low", "medium": "high", "high": "high", "xhigh": "max",
                     "max": "max"}
ERROR_PREFIX = "Error:"  # the first line of a tool_result with is_error
# the error code with which Anthropic refuses a `thread` it cannot hold; the SDK's tool
# runner then sends the whole conversation on every turn
THREAD_UNSUPPORTED = "thread_unsupported_request"


class TextBlock(StrictBody):
    type: Literal["text"]
    text: str


class ImageSource(StrictBody):
    type: Literal["base64", "url"]
    media_type: Optional[str] = None
    data: Optional[str] = None
    url: Optional[str] = None


class ImageBlock(StrictBody):
    type: Literal["image"]
    source: ImageSource


class ToolUseBlock(StrictBody):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


ResultPart = Annotated[Union[TextBlock, ImageBlock], Field(discriminator="type")]


class ToolResultBlock(StrictBody):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[ResultPart], None] = None
    is_error: Optional[bool] = False


class ThinkingBlock(StrictBody):
    type: Literal["thinking"]
    thinking: str
    signature: Optional[str] = None  # accepted back, never checked


class RedactedThinkingBlock(StrictBody):
    type: Literal["redacted_thinking"]
    data: Optional[str] = None


Block = Annotated[Union[TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock,
                        RedactedThinkingBlock], Field(discriminator="type")]
USER_BLOCKS = ("text", "image", "tool_result")
ASSISTANT_BLOCKS = ("text", "thinking", "redacted_thinking", "tool_use")


class Message(StrictBody):
    role: Literal["user", "assistant"]
    content: Union[str, list[Block]]


class Tool(StrictBody):
    name: str = Field(min_length=1)
    description: Optional[str] = None
    input_schema: Optional[dict] = None
    type: Optional[str] = None  # "custom" or absent; Anthropic's server tools are refused


class ToolChoice(StrictBody):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = False


class Thinking(StrictBody):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[whole_number(ge=1)] = None
    display: Optional[str] = None


class OutputConfig(StrictBody):
    effort: Optional[Literal["low", "medium", "high", "xhigh", "max"]] = None
    format: Optional[dict] = None


class Metadata(StrictBody):
    user_id: Optional[str] = None


class CountTokensRequest(StrictBody):
    """`POST /v1/messages/count_tokens`: what makes the prompt."""

    model: Optional[str] = None
    messages: list[Message] = Field(min_length=1)
    system: Union[str, list[TextBlock], None] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None
    output_config: Optional[OutputConfig] = None
    thread: Any = Field(None, description="a server-side thread: refused with error code "
                        f"{THREAD_UNSUPPORTED}, so that a client sends the whole conversation")


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages`. `seed` is this server's extension."""

    max_tokens: whole_number(ge=1)
    stop_sequences: Optional[list[str]] = None
    temperature: Optional[float] = Field(None, ge=0, le=1)
    top_p: Optional[float] = Field(None, ge=0, le=1)  # 0: the most likely token only
    top_k: Optional[whole_number(ge=0)] = None
    stream: Optional[bool] = False
    metadata: Optional[Metadata] = None
    seed: Optional[Seed] = None

    @property
    def user(self) -> Optional[str]:
        """`metadata.user_id`, under the name the app's processors hook reads."""
        return self.metadata.user_id if self.metadata else None


def parse_request(model_class, body):
    """Validate a decoded JSON body; RequestError naming the deepest field at fault."""
    request = parse(model_class, body, dotted=True)
    if request.thread is not None:
        raise RequestError("thread: this server keeps no threads; send the whole conversation "
                           "without `thread`", param="thread",
                           details={"error_code": THREAD_UNSUPPORTED})
    for k, message in enumerate(request.messages):
        if message.content == [] and not (message.role == "assistant"
                                          and k == len(request.messages) - 1):
            raise RequestError(f"messages.{k}.content: all messages must have non-empty "
                               "content except for the optional final assistant message",
                               param=f"messages.{k}.content")
    check_tool_names([tool.name for tool in request.tools or ()], lambda k: f"tools.{k}.name",
                     ANTHROPIC_TOOL_NAME)
    if isinstance(request, MessagesRequest):
        _check_budget(request)
    return request


def _check_budget(request: MessagesRequest) -> None:
    thinking = request.thinking
    if thinking is None or thinking.type != "enabled":
        return
    if thinking.budget_tokens is None:
        raise RequestError("thinking.budget_tokens: Field required (with type 'enabled')",
                           param="thinking.budget_tokens")
    if thinking.budget_tokens >= request.max_tokens:
        raise RequestError(f"thinking.budget_tokens: must be less than max_tokens "
                           f"({request.max_tokens})", param="thinking.budget_tokens")


# ----------------------------------------------------------------------------- replies

class AnthropicErrorDetail(BaseModel):
    type: str
    message: str
    details: Optional[dict] = None


class AnthropicError(BaseModel):
    """Anthropic's error body (`routes.error_body`)."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int


ReplyBlock = Annotated[Union[TextBlock, ThinkingBlock, ToolUseBlock], Field(discriminator="type")]


class AnthropicMessage(BaseModel):
    """A whole reply; streamed, Anthropic's named events."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ReplyBlock]
    stop_reason: Optional[Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]]
    stop_sequence: Optional[str]
    usage: AnthropicUsage


class TokenCount(BaseModel):
    input_tokens: int


class MessageStart(BaseModel):
    type: Literal["message_start"]
    message: AnthropicMessage  # with no content and no stop_reason yet


class BlockStart(BaseModel):
    type: Literal["content_block_start"]
    index: int
    content_block: ReplyBlock


class BlockDelta(BaseModel):
    type: Literal["content_block_delta"]
    index: int
    delta: dict  # text_delta, thinking_delta, signature_delta or input_json_delta


class BlockStop(BaseModel):
    type: Literal["content_block_stop"]
    index: int


class MessageDelta(BaseModel):
    type: Literal["message_delta"]
    delta: dict  # stop_reason and stop_sequence
    usage: AnthropicUsage


class Marker(BaseModel):
    type: Literal["message_stop", "ping"]


StreamEvent = Annotated[Union[MessageStart, BlockStart, BlockDelta, BlockStop, MessageDelta,
                              Marker, AnthropicError], Field(discriminator="type")]


# ----------------------------------------------------------------------------- conversion

@dataclass
class ToolUse:
    """How the request's `tool_choice` constrains the reply, in `constraint_fields`' terms."""

    calls: str = "auto"
    named: Optional[str] = None
    parallel: bool = True
    allow_calls: bool = True


def tool_use(request: CountTokensRequest) -> ToolUse:
    choice = request.tool_choice
    if choice is None or choice.type == "auto":
        return ToolUse()
    parallel = not choice.disable_parallel_tool_use
    if choice.type == "none":
        return ToolUse(calls="none", allow_calls=False)
    if choice.type == "any":
        return ToolUse(calls="required", parallel=parallel)
    if not choice.name:
        raise RequestError("tool_choice.name: Field required (with type 'tool')",
                           param="tool_choice.name")
    return ToolUse(named=choice.name, parallel=parallel)


def function_specs(request: CountTokensRequest) -> list:
    """The request's tools as function specs `{"name", "description", "parameters"}`."""
    specs = []
    for k, tool in enumerate(request.tools or ()):
        where = f"tools.{k}"
        if tool.type not in (None, "custom"):
            raise RequestError(f"{where}.type: the server tool {tool.type!r} is not supported "
                               "(client tools with an input_schema only)", param=f"{where}.type")
        if tool.input_schema is None:
            raise RequestError(f"{where}.input_schema: Field required",
                               param=f"{where}.input_schema")
        if tool.input_schema.get("type") != "object":
            raise RequestError(f"{where}.input_schema.type: must be 'object'",
                               param=f"{where}.input_schema.type")
        spec = {"name": tool.name, "description": tool.description,
                "parameters": tool.input_schema}
        specs.append({key: value for key, value in spec.items() if value is not None})
    return specs


def thinking_mode(request: CountTokensRequest, default_thinking: bool,
                  default_effort) -> tuple:
    """(thinking, reasoning effort, reasoning budget or None). `thinking` absent: the
    server's mode; "disabled": chat mode; "enabled": thinking with an effort from
    `budget_tokens` (BUDGET_EFFORTS) and that budget as a hard cap; "adaptive": thinking.
    `output_config.effort`, when given, sets the effort."""
    config = request.output_config
    effort = ANTHROPIC_EFFORTS[config.effort] if config and config.effort else None
    thinking = request.thinking
    if thinking is None:
        return default_thinking, effort or default_effort, None
    if thinking.type == "disabled":
        return False, default_effort, None
    if thinking.type == "adaptive" or thinking.budget_tokens is None:
        return True, effort or default_effort, None
    return True, effort or budget_effort(thinking.budget_tokens), thinking.budget_tokens


def budget_effort(budget: int) -> str:
    return next((effort for bound, effort in BUDGET_EFFORTS if budget < bound),
                LARGEST_BUDGET_EFFORT)


def answer_schema(request: CountTokensRequest):
    """`output_config.format`'s JSON schema (type "json_schema"), or None."""
    config = request.output_config
    form = config.format if config else None
    if not form:
        return None
    if form.get("type") != "json_schema" or not isinstance(form.get("schema"), dict):
        raise RequestError("output_config.format: expected {\"type\": \"json_schema\", "
                           "\"schema\": {...}}", param="output_config.format")
    return form["schema"]


def chat_messages(request: CountTokensRequest, system_prompt: Optional[str],
                  images: ImageReader) -> list:
    """The request as `chat.format` message dicts: `system` first (else `system_prompt`),
    user text and images, tool results as "tool" messages, assistant turns with their
    `reasoning_content` (thinking blocks) and `tool_calls` (tool_use blocks)."""
    out = []
    system = request.system
    if isinstance(system, list):
        system = [{"type": "text", "text": block.text} for block in system]
    if system or system_prompt:
        out.append({"role": "system", "content": system or system_prompt})
    calls: set = set()  # tool_use ids of the last assistant message
    for k, message in enumerate(request.messages):
        where = f"messages.{k}"
        blocks = [TextBlock(type="text", text=message.content)] \
            if isinstance(message.content, str) else message.content
        allowed = ASSISTANT_BLOCKS if message.role == "assistant" else USER_BLOCKS
        for j, block in enumerate(blocks):
            if block.type not in allowed:
                raise RequestError(f"{where}.content.{j}: a {block.type} block is not allowed "
                                   f"in a {message.role} message", param=f"{where}.content.{j}")
        if message.role == "assistant":
            out.append(_assistant(blocks))
            calls = {block.id for block in blocks if block.type == "tool_use"}
        else:
            out += _user(blocks, where, images, calls)
    return out


def _assistant(blocks: list) -> dict:
    entry = {"role": "assistant",
             "content": "".join(b.text for b in blocks if b.type == "text")}
    reasoning = "".join(b.thinking for b in blocks if b.type == "thinking")
    if reasoning:
        entry["reasoning_content"] = reasoning
    uses = [b for b in blocks if b.type == "tool_use"]
    if uses:
        entry["tool_calls"] = [{"id": b.id, "type": "function",
                                "function": {"name": b.name, "arguments": b.input}}
                               for b in uses]
    return entry


def _user(blocks: list, where: str, images: ImageReader, calls: set) -> list:
    """A user message as messages: each tool result a "tool" message, each run of text and
    image blocks a "user" message, in their order (the chat format merges them in one turn)."""
    out, pending = [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content.{j}"
        if block.type != "tool_result":
            pending.append(_part(block, "user", at, images))
            continue
        if pending:
            out.append({"role": "user", "content": pending})
            pending = []
        if block.tool_use_id not in calls:
            raise RequestError(f"{at}.tool_use_id: no tool_use block with id "
                               f"{block.tool_use_id!r} in the last assistant message",
                               param=f"{at}.tool_use_id")
        out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                    "content": _result_content(block, at, images)})
    if pending:
        out.append({"role": "user", "content": pending})
    return out


def _result_content(block: ToolResultBlock, where: str, images: ImageReader):
    content = block.content
    if isinstance(content, list):
        content = [_part(part, "tool", f"{where}.content.{i}", images)
                   for i, part in enumerate(content)]
    if not block.is_error:
        return content or ""
    if not isinstance(content, list):
        content = [{"type": "text", "text": content}] if content else []
    return [{"type": "text", "text": ERROR_PREFIX}] + content


def _part(block, role: str, where: str, images: ImageReader) -> dict:
    """A text or image block as the chat format's block."""
    if block.type == "text":
        return {"type": "text", "text": block.text}
    source = block.source
    if source.type == "url":
        raise RequestError(f"{where}.source: image URLs are not fetched by this server; send "
                           "the image inline as a base64 source", param=f"{where}.source")
    for name in ("media_type", "data"):
        if getattr(source, name) is None:
            raise RequestError(f"{where}.source.{name}: Field required",
                               param=f"{where}.source.{name}")
    uri = f"data:{source.media_type};base64,{source.data}"
    return images.block(ContentPart(type="image_url", image_url=uri), role, where)
