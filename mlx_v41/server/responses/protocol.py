"""The OpenAI Responses API's request in V4.1's terms: the body as a typed model, its input
items (messages, function calls and their outputs, reasoning) as the chat format's message
dicts, its flat function tools, `tool_choice`, `text.format` and `reasoning.effort`.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any, Literal, Optional, Union

from pydantic import Field, ValidationError

from ...generation.sequence import MAX_SEED
from ..bodies import ContentPart, StrictBody
from ..constraints import answer_format as format_of
from ..conversation import thinking_mode
from ..errors import RequestError
from ..images import IMAGE_PART_TYPES, ImageReader

TEXT_PART_TYPES = ("input_text", "output_text", "text")
NOT_SUPPORTED = ("background", "conversation", "prompt")  # fields refused when set


class FunctionTool(StrictBody):
    type: Literal["function"]
    name: str
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None


class TextFormat(StrictBody):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: Optional[str] = None
    schema_: Optional[dict] = Field(None, alias="schema")
    description: Optional[str] = None
    strict: Optional[bool] = None


class TextConfig(StrictBody):
    format: TextFormat = TextFormat()
    verbosity: Optional[str] = None


class ReasoningConfig(StrictBody):
    effort: Union[str, int, None] = None
    summary: Optional[str] = None


class ResponsesRequest(StrictBody):
    model: Optional[str] = None
    input: Union[str, list[dict]]
    instructions: Optional[str] = None
    tools: Optional[list[dict]] = None
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: bool = True
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    seed: Optional[int] = Field(None, ge=0, le=MAX_SEED)  # an extension, as in chat requests
    text: Optional[TextConfig] = None
    reasoning: Optional[ReasoningConfig] = None
    store: bool = True
    previous_response_id: Optional[str] = None
    stream: bool = False
    user: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    chat_template_kwargs: Optional[dict] = None  # an extension: `thinking` true/false
    background: Optional[bool] = None
    conversation: Any = None
    prompt: Any = None


# ----------------------------------------------------------------------------- input items

class InputPart(StrictBody):
    type: str
    text: Optional[str] = None
    image_url: Optional[Any] = None


class MessageItem(StrictBody):
    type: Literal["message"] = "message"
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
    summary: list[ReasoningPart] = []
    content: Optional[list[ReasoningPart]] = None


ITEM_TYPES = {"message": MessageItem, "function_call": FunctionCallItem,
              "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}


def validated(model_class, value, where: str):
    """`value` as `model_class`; a RequestError naming the field (`input[3].call_id`)."""
    try:
        return model_class.model_validate(value)
    except ValidationError as e:
        error = e.errors()[0]
        at = (where + "".join(f"[{p}]" if isinstance(p, int) else f".{p}"
                              for p in error["loc"])).lstrip(".") or "body"
        raise RequestError(f"{at}: {error['msg']}", param=at) from None


def input_items(body: ResponsesRequest) -> list:
    """The request's `input` as a list of item dicts (a string is one user message)."""
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}]
    return list(body.input)


def parse_item(item: dict, where: str):
    kind = item.get("type", "message")
    if kind not in ITEM_TYPES:
        raise RequestError(f"{where}.type: input item type {kind!r} is not supported (message, "
                           f"function_call, function_call_output, reasoning)",
                           param=f"{where}.type")
    return validated(ITEM_TYPES[kind], item, where)


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
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            raise RequestError(f"{where}.arguments: not a JSON object", param=f"{where}.arguments")
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
        tools.append(validated(FunctionTool, tool, f"tools[{k}]"))
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
