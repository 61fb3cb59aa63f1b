"""OpenAI chat requests in V4.1's terms: messages as the chat format's dicts (image parts as
its image blocks), the thinking mode and reasoning effort, and `tool_choice`.
"""

from __future__ import annotations

from typing import Optional

from ..constraints import answer_format, constraint_fields
from ..errors import RequestError
from ..images import IMAGE_PART_TYPES, ImageReader
from .protocol import ChatCompletionRequest, ChatMessage

NO_VISION = ImageReader(None)  # what a caller that names no reader gets: images refused


def _content(message: ChatMessage, where: str, images: ImageReader):
    """Message content for the chat format: a string, or its text and image blocks."""
    if not isinstance(message.content, list):
        return message.content
    blocks = []
    for k, part in enumerate(message.content):
        at = f"{where}.content[{k}]"
        if part.type in IMAGE_PART_TYPES:
            blocks.append(images.block(part, message.role, at))
        elif part.type == "text" and part.text is not None:
            blocks.append({"type": "text", "text": part.text})
        else:
            raise RequestError(f"{at}: content part type {part.type!r} is not supported "
                               "(text and image parts only)", param=at)
    return blocks


def _tool_calls(message: ChatMessage) -> list:
    return [{"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}
            for call in message.tool_calls or ()]


def chat_messages(request: ChatCompletionRequest, system_prompt: Optional[str] = None,
                  images: ImageReader = NO_VISION) -> list:
    """The request's messages as `chat.format` dicts (developer messages are system
    messages); `system_prompt` opens a conversation that has no system message; `images`
    decodes image parts (into blocks `chat.format.collect_images` finds)."""
    out = []
    for k, message in enumerate(request.messages):
        where = f"messages[{k}]"
        entry = {"role": "system" if message.role == "developer" else message.role,
                 "content": _content(message, where, images)}
        if message.role == "assistant":
            reasoning = message.reasoning_content or message.reasoning
            if reasoning:
                entry["reasoning_content"] = reasoning
            if message.tool_calls:
                entry["tool_calls"] = _tool_calls(message)
        if message.role == "tool":
            entry["tool_call_id"] = message.tool_call_id
        out.append(entry)
    if system_prompt and out[0]["role"] != "system":
        out.insert(0, {"role": "system", "content": system_prompt})
    return out


def allows_tool_calls(request: ChatCompletionRequest) -> bool:
    """Whether a DSML block may be generated: every `tool_choice` but "none" (which keeps
    the tools in the prompt, so its cache is the same, and masks the DSML token)."""
    return tool_choice(request)[0] != "none"


def tool_choice(request: ChatCompletionRequest) -> tuple:
    """(calls, named): "auto" / "none" / "required" and the forced function's name (or None)
    from OpenAI's `tool_choice`."""
    choice = request.tool_choice
    if choice is None:
        return "auto", None
    if choice in ("auto", "none", "required"):
        return choice, None
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function"
            and isinstance(name, str)):
        raise RequestError(f"tool_choice must be 'auto', 'none', 'required' or "
                           f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got "
                           f"{choice!r}", param="tool_choice")
    return "required", name


def request_constraint(request: ChatCompletionRequest, tokenizer, thinking: bool):
    """The constraint fields of a chat completion (`constraints.constraint_fields`): forced
    calls from `tool_choice`, the answer from `response_format`."""
    calls, named = tool_choice(request)
    tools = [tool.function.model_dump(exclude_none=True) for tool in request.tools or ()]
    return constraint_fields(tokenizer, tools=tools, calls=calls, named=named,
                             answer=answer_format(request.response_format), thinking=thinking,
                             parallel=request.parallel_tool_calls,
                             params={"tools": "tools", "tool_choice": "tool_choice",
                                     "format": "response_format"})
