"""A generated assistant turn read back (DeepSeek V4.1's chat format, `format.py`):
`parse_completion` splits it into reasoning, answer and DSML tool calls as the reference parser
does; `held_suffix` is the text a stream holds back while it may still become a marker.
"""

import json
import re

from .format import (CALLS_CLOSE, CALLS_OPEN, EOS, INVOKE_CLOSE, INVOKE_OPEN, PARAM_CLOSE,
                     PARAM_OPEN, SPECIAL_TOKEN_IDS, THINK_END, check_thinking_mode)

_INVOKE_RE = re.compile(rf'{INVOKE_OPEN} name="([^"]*)">(.*?){INVOKE_CLOSE}', re.S)
_PARAM_RE = re.compile(rf'{PARAM_OPEN} name="([^"]*)" string="(true|false)">(.*?){PARAM_CLOSE}',
                       re.S)


def _scan(pattern, text, what):
    """All matches of `pattern` in `text`, which must hold nothing else but whitespace."""
    matches, position = [], 0
    for match in pattern.finditer(text):
        if text[position:match.start()].strip():
            break
        matches.append(match)
        position = match.end()
    if text[position:].strip():
        raise ValueError(f"malformed DSML {what}: unexpected text {text[position:][:60]!r}")
    return matches


def _parse_parameter(match):
    name, flag, value = match.groups()
    if flag == "true":
        return name, value
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        raise ValueError(f"DSML parameter {name!r} has string=\"false\" but its value "
                         f"{value[:60]!r} is not JSON") from None


def _parse_tool_calls(block):
    """The `<｜DSML｜ calls>` block -> OpenAI-style tool calls with JSON-string arguments."""
    if not (block.startswith(CALLS_OPEN) and block.endswith(CALLS_CLOSE)):
        raise ValueError("malformed DSML tool-call block: it must run from "
                         f"{CALLS_OPEN} to {CALLS_CLOSE} and be followed only by EOS")
    inner = block[len(CALLS_OPEN):-len(CALLS_CLOSE)]
    calls = []
    for invoke in _scan(_INVOKE_RE, inner, "invoke"):
        params = _scan(_PARAM_RE, invoke.group(2), "parameter")
        arguments = dict(_parse_parameter(match) for match in params)
        calls.append({"type": "function", "function": {
            "name": invoke.group(1), "arguments": json.dumps(arguments, ensure_ascii=False)}})
    return calls


def _split_eos(text):
    """(text before EOS, whether EOS was present); nothing may follow EOS."""
    index = text.find(EOS)
    if index < 0:
        return text, False
    if text[index + len(EOS):]:
        raise ValueError(f"completion has text after {EOS}: {text[index + len(EOS):][:60]!r}")
    return text[:index], True


def _check_no_special_tokens(text, field):
    """Special tokens never occur inside parsed text (reference parser rule)."""
    for token in SPECIAL_TOKEN_IDS:
        if token in text:
            raise ValueError(f"special token {token} inside the parsed {field}")


def parse_completion(text, thinking_mode="chat") -> dict:
    """Split generated assistant text (what follows the generation header) into its fields.

    Args:
        text: the decoded completion, with or without the trailing EOS text.
        thinking_mode: the prompt's mode. Thinking: reasoning runs up to `</think>`, required in a
            finished turn; an unfinished turn without it is all reasoning so far.

    Returns:
        {"role": "assistant", "reasoning_content", "content", "tool_calls" (OpenAI-style,
        `arguments` a JSON string), "is_finished" (whether the EOS text ended the turn)}.

    Raises:
        ValueError: on malformed structure or special tokens inside reasoning/content.
    """
    check_thinking_mode(thinking_mode)
    body, is_finished = _split_eos(text)
    reasoning = ""
    if thinking_mode == "thinking":
        reasoning, found, body = body.partition(THINK_END)
        if not found and is_finished:
            raise ValueError(f"thinking-mode completion ended without {THINK_END}")
    content, found, calls_block = body.partition(CALLS_OPEN)
    tool_calls = _parse_tool_calls(found + calls_block) if found else []
    content = content.removesuffix("\n\n") if found else content
    _check_no_special_tokens(reasoning, "reasoning_content")
    _check_no_special_tokens(content, "content")
    return {"role": "assistant", "reasoning_content": reasoning, "content": content,
            "tool_calls": tool_calls, "is_finished": is_finished}


def held_suffix(text: str, markers) -> int:
    """Length of the longest end of `text` that starts one of `markers` (a proper prefix):
    text a stream may still turn into a marker, held back until the next piece decides."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best
