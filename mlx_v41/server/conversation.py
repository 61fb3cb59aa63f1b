"""What every chat API does to a conversation before the chat format renders it: the thinking
mode and reasoning effort (OpenAI's names mapped onto V4.1's), and a JSON answer format put on
the system message.
"""

from __future__ import annotations

from typing import Optional

from ..chat import format as cf
from .errors import RequestError

# OpenAI's reasoning_effort names on V4.1's scale; V4.1's own (low, high, max, 1-100) pass.
OPENAI_EFFORTS = {"minimal": "low", "medium": "high", "xhigh": "max"}
NO_REASONING = "none"  # OpenAI's "no reasoning": V4.1's chat mode


def with_response_format(messages: list, response_format: Optional[dict]) -> list:
    """`messages` with a JSON `response_format` on the system message, where the chat format
    renders it (the official encoding tells the model the schema; the grammar enforces it);
    a conversation without a system message gets an empty one."""
    if not response_format or response_format.get("type") == "text":
        return messages
    if not messages or messages[0]["role"] != "system":
        messages = [{"role": "system", "content": ""}] + messages
    return [dict(messages[0], response_format=response_format)] + messages[1:]


def thinking_mode(request, default_thinking: bool, default_effort):
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
