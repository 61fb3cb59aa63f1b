"""OpenAI chat requests in V4.1's terms: messages as the chat format's dicts (image parts as
its image blocks), the thinking mode and reasoning effort, and `tool_choice`.
"""

from __future__ import annotations

from typing import Optional

from ..chat import format as cf
from .images import IMAGE_PART_TYPES, ImageReader
from .constraints import constraint_fields
from .protocol import ChatCompletionRequest, ChatMessage, RequestError, answer_format

# OpenAI's reasoning_effort names on V4.1's scale; V4.1's own (low, high, max, 1-100) pass.
OPENAI_EFFORTS = {"minimal": "low", "medium": "high", "xhigh": "max"}
NO_REASONING = "none"  # OpenAI's "no reasoning": V4.1's chat mode
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


def with_response_format(messages: list, response_format: Optional[dict]) -> list:
    """`messages` with a JSON `response_format` on the system message, where the chat format
    renders it (the official encoding tells the model the schema; the grammar enforces it);
    a conversation without a system message gets an empty one."""
    if not response_format or response_format.get("type") == "text":
        return messages
    if not messages or messages[0]["role"] != "system":
        messages = [{"role": "system", "content": ""}] + messages
    return [dict(messages[0], response_format=response_format)] + messages[1:]


def thinking_mode(request: ChatCompletionRequest, default_thinking: bool, default_effort):
    """(thinking, reasoning_effort) from `chat_template_kwargs.thinking` (or
    `enable_thinking`) and `reasoning_effort`; "none" is chat mode, an effort alone turns
    thinking on."""
    kwargs = request.chat_template_kwargs or {}
    thinking = kwargs.get("thinking", kwargs.get("enable_thinking"))
    if thinking is not None and not isinstance(thinking, bool):
        raise RequestError("chat_template_kwargs.thinking must be true or false",
                           param="chat_template_kwargs.thinking")
    effort = request.reasoning_effort
    if effort == NO_REASONING:
        return False, default_effort
    effort = OPENAI_EFFORTS.get(effort, effort)
    if effort is not None:
        try:
            cf.resolve_reasoning_effort(effort)
        except ValueError as e:
            raise RequestError(str(e), param="reasoning_effort") from None
    if thinking is None:
        thinking = default_thinking if effort is None else True
    return thinking, default_effort if effort is None else effort


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
