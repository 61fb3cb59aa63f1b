"""OpenAI chat requests in V4.1's terms: messages as the chat format's dicts (image parts as
its image blocks), the thinking mode and reasoning effort, and `tool_choice`.
"""

from __future__ import annotations

import json
from typing import Optional

from ..bodies import check_text
from ..constraints import answer_format, constraint_fields
from ..errors import RequestError
from ..images import IMAGE_PART_TYPES, ImageReader
from .protocol import ChatCompletionRequest, ChatMessage

NO_VISION = ImageReader(None)  # what a caller that names no reader gets: images refused


def _content(message: ChatMessage, where: str, images: ImageReader):
    """Message content for the chat format: a string, or its text and image blocks (an
    assistant's refusal parts as text)."""
    if not isinstance(message.content, list):
        return message.content
    blocks = []
    for k, part in enumerate(message.content):
        at = f"{where}.content[{k}]"
        if part.type in IMAGE_PART_TYPES:
            blocks.append(images.block(part, message.role, at))
        elif part.type == "text" and part.text is not None:
            blocks.append({"type": "text", "text": part.text})
        elif part.type == "refusal" and message.role == "assistant" and part.refusal is not None:
            blocks.append({"type": "text", "text": part.refusal})
        else:
            raise RequestError(f"{at}: content part type {part.type!r} is not supported "
                               "(text and image parts; refusal parts in assistant messages)",
                               param=at)
    return blocks


def _tool_calls(message: ChatMessage, where: str) -> list:
    calls = []
    for k, call in enumerate(message.tool_calls or ()):
        arguments = call.function.arguments
        _check_arguments(arguments, f"{where}.tool_calls[{k}].function.arguments")
        calls.append({"id": call.id, "type": "function",
                      "function": {"name": call.function.name, "arguments": arguments}})
    return calls


def _check_arguments(arguments, where: str) -> None:
    """Arguments the chat format can render: a JSON object (or its text), whose strings hold
    valid text (`check_text`)."""
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError) as e:
            raise RequestError(f"{where}: not valid JSON ({e})", param=where) from None
        if not isinstance(arguments, dict):
            raise RequestError(f"{where}: must be a JSON object, got "
                               f"{type(arguments).__name__}", param=where)
    check_text(arguments, where, chat=True)


def chat_messages(request: ChatCompletionRequest, system_prompt: Optional[str] = None,
                  images: ImageReader = NO_VISION) -> list:
    """The request's messages as `chat.format` dicts (developer messages are system
    messages); `system_prompt` opens a conversation that has no system message; `images`
    decodes image parts (into blocks `chat.format.collect_images` finds)."""
    out, calls = [], set()  # the call ids of the last assistant message
    for k, message in enumerate(request.messages):
        where = f"messages[{k}]"
        entry = {"role": "system" if message.role == "developer" else message.role,
                 "content": _content(message, where, images)}
        if message.role == "assistant":
            reasoning = message.reasoning_content or message.reasoning
            if reasoning:
                entry["reasoning_content"] = reasoning
            if message.tool_calls:
                entry["tool_calls"] = _tool_calls(message, where)
            calls = {call.id for call in message.tool_calls or () if call.id}
        if message.role == "tool":
            _check_answers(message.tool_call_id, calls, where)
            entry["tool_call_id"] = message.tool_call_id
        out.append(entry)
    if system_prompt and out[0]["role"] != "system":
        out.insert(0, {"role": "system", "content": system_prompt})
    return out


def _check_answers(call_id: Optional[str], calls: set, where: str) -> None:
    """A tool message answers a call of the last assistant message (when it made calls)."""
    if call_id and calls and call_id not in calls:
        raise RequestError(f"{where}.tool_call_id: no tool call with id {call_id!r} in the last "
                           "assistant message", param=f"{where}.tool_call_id")


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
