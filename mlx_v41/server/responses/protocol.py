"""The OpenAI Responses API's request in V4.1's terms: the body as a typed model, its input
items (messages, function calls and their outputs, reasoning) as the chat format's message
dicts, its flat function tools, `tool_choice`, `text.format` and `reasoning.effort`; and the
response object's model.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, Field, WithJsonSchema

from ..bodies import (ContentPart, Int, ObjectSchema, Seed, StrictBody, check_text,
                      check_tool_names, parse, schema_of, whole_number)
from ..constraints import answer_format as format_of
from ..conversation import thinking_mode
from ..errors import RequestError
from ..images import IMAGE_PART_TYPES, ImageReader

TEXT_PART_TYPES = ("input_text", "output_text", "text")
NOT_SUPPORTED = ("background", "conversation", "prompt")  # fields refused when set


# ----------------------------------------------------------------------------- input items

class InputPart(StrictBody):
    type: str
    text: Optional[str] = None
    image_url: Optional[Any] = None


class MessageItem(StrictBody):
    type: Optional[Literal["message"]] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[InputPart]]


class FunctionCallItem(StrictBody):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(StrictBody):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[InputPart]]


class ReasoningPart(StrictBody):
    type: str
    text: str


class ReasoningItem(StrictBody):
    type: Literal["reasoning"]
    summary: Optional[list[ReasoningPart]] = []
    content: Optional[list[ReasoningPart]] = None


ITEM_TYPES = {"message": MessageItem, "function_call": FunctionCallItem,
              "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}


class FunctionTool(StrictBody):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[ObjectSchema] = None
    strict: Optional[bool] = None


class TextFormat(StrictBody):
    type: Optional[Literal["text", "json_object", "json_schema"]] = "text"
    name: Optional[str] = None
    schema_: Optional[dict] = Field(None, alias="schema")
    description: Optional[str] = None
    strict: Optional[bool] = None


class TextConfig(StrictBody):
    format: Optional[TextFormat] = TextFormat()
    verbosity: Optional[str] = None


class ReasoningConfig(StrictBody):
    effort: Union[str, Int, None] = None
    summary: Optional[str] = None


# Items and tools are read one by one (`parse_item`, `function_tools`), so that an unknown
# item or tool type is refused by name; the schema declares what those accept.
Items = Annotated[list[dict], WithJsonSchema(
    {"type": "array", "items": schema_of(Union[tuple(ITEM_TYPES.values())])})]
Tools = Annotated[list[dict], WithJsonSchema({"type": "array", "items": schema_of(FunctionTool)})]


class ResponsesRequest(StrictBody):
    model: Optional[str] = None
    input: Union[str, Items]
    instructions: Optional[str] = None
    tools: Optional[Tools] = None
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: Optional[bool] = True
    max_output_tokens: Optional[whole_number(ge=1)] = None
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, ge=0, le=1)  # 0: the most likely token only
    seed: Optional[Seed] = None  # an extension, as in chat requests
    text: Optional[TextConfig] = None
    reasoning: Optional[ReasoningConfig] = None
    store: Optional[bool] = True
    previous_response_id: Optional[str] = None
    stream: Optional[bool] = False
    user: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    chat_template_kwargs: Optional[dict] = None  # an extension: `thinking` true/false
    background: Optional[bool] = None
    conversation: Any = None
    prompt: Any = None


def parse_request(body) -> ResponsesRequest:
    """The validated request body; RequestError naming the field at fault."""
    return parse(ResponsesRequest, body)


def input_items(body: ResponsesRequest) -> list:
    """The request's `input` as a list of item dicts (a string is one user message)."""
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}]
    return list(body.input)


def parse_item(item: dict, where: str):
    kind = item.get("type") or "message"
    if not isinstance(kind, str) or kind not in ITEM_TYPES:
        raise RequestError(f"{where}.type: input item type {kind!r} is not supported (message, "
                           f"function_call, function_call_output, reasoning)",
                           param=f"{where}.type")
    return parse(ITEM_TYPES[kind], item, where=where)


class Conversation:
    """Input items turned into chat-format messages, in order. A reasoning item opens an
    assistant turn that the next assistant message and function calls join, as a reply's
    output items came from one turn."""

    def __init__(self, images: ImageReader):
        self.images, self.messages, self.calls = images, [], set()
        self.open: Optional[dict] = None  # the assistant turn items may still join

    def add(self, item: dict, where: str) -> None:
        parsed = parse_item(item, where)
        step = {MessageItem: self._message, FunctionCallItem: self._call,
                FunctionCallOutputItem: self._output, ReasoningItem: self._reasoning}
        step[type(parsed)](parsed, where)

    def _message(self, item: MessageItem, where: str) -> None:
        content = self._content(item.content, item.role, f"{where}.content")
        if item.role != "assistant":
            self.open = None
            role = "user" if item.role == "user" else "system"
            self.messages.append({"role": role, "content": content})
            return
        turn = self.open
        if turn is None or turn["content"] or turn.get("tool_calls"):
            turn = self._assistant()
        turn["content"] = content

    def _call(self, item: FunctionCallItem, where: str) -> None:
        try:
            arguments = json.loads(item.arguments or "{}")
        except (json.JSONDecodeError, RecursionError):
            arguments = None
        if not isinstance(arguments, dict):
            raise RequestError(f"{where}.arguments: not a JSON object", param=f"{where}.arguments")
        check_text(arguments, f"{where}.arguments", chat=True)
        turn = self.open or self._assistant()
        turn.setdefault("tool_calls", []).append(
            {"id": item.call_id, "type": "function",
             "function": {"name": item.name, "arguments": item.arguments}})
        self.calls.add(item.call_id)

    def _output(self, item: FunctionCallOutputItem, where: str) -> None:
        if item.call_id not in self.calls:
            raise RequestError(f"{where}.call_id: no function_call with call_id "
                               f"{item.call_id!r} comes before it", param=f"{where}.call_id")
        self.open = None
        self.messages.append({"role": "tool", "tool_call_id": item.call_id,
                              "content": self._content(item.output, "tool", f"{where}.output")})

    def _reasoning(self, item: ReasoningItem, where: str) -> None:
        parts = item.content or item.summary
        self._assistant()["reasoning_content"] = "\n\n".join(p.text for p in parts)

    def _assistant(self) -> dict:
        self.open = {"role": "assistant", "content": ""}
        self.messages.append(self.open)
        return self.open

    def _content(self, content, role: str, where: str):
        """A string, or text and image blocks (images decoded by the reader)."""
        if isinstance(content, str):
            return content
        blocks = []
        for k, part in enumerate(content):
            at = f"{where}[{k}]"
            if part.type in IMAGE_PART_TYPES:
                image = ContentPart(type=part.type, image_url=part.image_url)
                blocks.append(self.images.block(image, role, at))
            elif part.type in TEXT_PART_TYPES and part.text is not None:
                blocks.append({"type": "text", "text": part.text})
            else:
                raise RequestError(f"{at}: content part type {part.type!r} is not supported "
                                   "(input_text, output_text, input_image)", param=f"{at}.type")
        return blocks


# ----------------------------------------------------------------------------- tools and modes

def function_tools(body: ResponsesRequest) -> list:
    """The request's tools as `FunctionTool`s; built-in tools are refused by name."""
    tools = []
    for k, tool in enumerate(body.tools or ()):
        kind = tool.get("type")
        if kind != "function":
            raise RequestError(f"tools[{k}].type: {kind!r} tools are not supported by this "
                               "server (function tools only)", param=f"tools[{k}].type")
        tools.append(parse(FunctionTool, tool, where=f"tools[{k}]"))
    check_tool_names([tool.name for tool in tools], lambda k: f"tools[{k}].name")
    return tools


def tool_spec(tool: FunctionTool) -> dict:
    """A function tool as the chat format's function spec (what chat completions render)."""
    return tool.model_dump(exclude_none=True, exclude={"type"})


def tool_choice(body: ResponsesRequest) -> tuple:
    """(calls: "auto" / "none" / "required", the named function or None)."""
    choice = body.tool_choice
    if choice is None or choice in ("auto", "none", "required"):
        return choice or "auto", None
    if isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("name"), str):
        return "required", choice["name"]
    raise RequestError(f"tool_choice {choice!r} is not supported ('auto', 'none', 'required' "
                       "or {\"type\": \"function\", \"name\": ...})", param="tool_choice")


def answer_format(body: ResponsesRequest):
    """What `text.format` asks of the answer: None (text), "json_object" or a JSON schema."""
    if body.text is None:
        return None
    return format_of(body.text.format.model_dump(by_alias=True, exclude_none=True),
                                  "text.format")


def reasoning_mode(body: ResponsesRequest, default_thinking: bool, default_effort) -> tuple:
    """(thinking, effort) as chat completions' `reasoning_effort` maps them: "none" is chat
    mode, OpenAI's other efforts sit on V4.1's scale and turn thinking on."""
    effort = body.reasoning.effort if body.reasoning else None
    request = SimpleNamespace(chat_template_kwargs=body.chat_template_kwargs,
                              reasoning_effort=effort)
    try:
        return thinking_mode(request, default_thinking, default_effort)
    except RequestError as e:
        if e.param != "reasoning_effort":
            raise
        raise RequestError(f"reasoning.effort: {e}", param="reasoning.effort") from None


def check_supported(body: ResponsesRequest) -> None:
    for name in NOT_SUPPORTED:
        if getattr(body, name):
            raise RequestError(f"{name} is not supported by this server", param=name)


# ----------------------------------------------------------------------------- the response

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list
    logprobs: list


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: ItemStatus
    content: list[OutputText]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"]
    text: str


class OutputReasoning(BaseModel):
    id: str
    type: Literal["reasoning"]
    summary: list
    content: list[ReasoningText]
    status: ItemStatus


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = Annotated[Union[OutputMessage, OutputReasoning, OutputFunctionCall],
                       Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int
    cache_write_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class Response(BaseModel):
    """A response object: returned whole, stored, or built by the stream's events."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "cancelled", "failed"]
    background: bool
    error: Optional[dict]
    incomplete_details: Optional[dict]
    instructions: Optional[str]
    max_output_tokens: Optional[int]
    metadata: dict[str, str]
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: Optional[str]
    reasoning: dict
    store: bool
    temperature: float
    text: dict
    tool_choice: Union[str, dict]
    tools: list[dict]
    top_p: float
    truncation: str
    usage: Optional[ResponseUsage]
    user: Optional[str]


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"]
    deleted: bool


class ResponseEvent(BaseModel):
    """A streamed response's event: its type and number, and what it carries."""

    type: str
    sequence_number: int
    response: Optional[Response] = None
    output_index: Optional[int] = None
    item_id: Optional[str] = None
    item: Optional[OutputItem] = None
    content_index: Optional[int] = None
    part: Optional[Union[OutputText, ReasoningText]] = None
    delta: Optional[str] = None
    text: Optional[str] = None
    arguments: Optional[str] = None
