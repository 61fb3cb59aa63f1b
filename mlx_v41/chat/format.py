"""Chat format of DeepSeek V4.1: special tokens and prompt rendering.

No Jinja template ships: `encode_messages` restates the official `encoding/encoding.py` rules.
Reading a generated turn back is `completion.py`'s.
"""

import json
import numbers
from typing import NamedTuple

# Special token strings; the bars are U+FF5C and the word separators U+2581.
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
SYSTEM = "<｜System｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
LATEST_REMINDER = "<｜latest_reminder｜>"
IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"
# Quick-instruction tasks (internal; not used by normal chat).
TASK_TOKENS = {name: f"<｜{name}｜>"
               for name in ("action", "query", "authority", "domain", "title", "read_url")}

# Only 0, 1, 2, 128799, 128803, 128804, 128822, 129264 are confirmed by the config; the rest come
# from a transcription of the tokenizer and must be checked against tokenizer.json at load.
SPECIAL_TOKEN_IDS = {
    BOS: 0, EOS: 1, PAD: 2, SYSTEM: 128799, USER: 128803, ASSISTANT: 128804,
    THINK_START: 128821, THINK_END: 128822, DSML: 128825, LATEST_REMINDER: 128828,
    TASK_TOKENS["action"]: 128829, TASK_TOKENS["query"]: 128830,
    TASK_TOKENS["authority"]: 128831, TASK_TOKENS["domain"]: 128832,
    TASK_TOKENS["title"]: 128836, TASK_TOKENS["read_url"]: 128845,
    IMAGE_PLACEHOLDER: 129264,
}
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
IMAGE_TOKEN_ID = 129264
END_OF_TURN_TOKENS = (EOS_ID,)  # EOS ends every assistant turn and is the only stop id

THINKING_MODES = ("chat", "thinking")
ROLES = ("system", "user", "assistant", "tool", "latest_reminder")
REASONING_EFFORT_ALIASES = {"low": 50, "high": 75, "max": 100}  # released encoder, tech report
DEFAULT_REASONING_EFFORT = "high"
IMAGE_BLOCK_TYPES = ("image", "image_url")

EFFORT_LINE = ("Reasoning Effort: {} (range 1-100, the higher the value, "
               "the more thorough the reasoning)\n\n")
RESPONSE_FORMAT_HEAD = ("\n\n## Response Format:\n\nYou MUST strictly adhere to the following "
                        "schema to reply:\n")

CALLS_OPEN, CALLS_CLOSE = f"<{DSML} calls>", f"</{DSML} calls>"
INVOKE_OPEN, INVOKE_CLOSE = f"<{DSML} invoke", f"</{DSML} invoke>"
PARAM_OPEN, PARAM_CLOSE = f"<{DSML} parameter", f"</{DSML} parameter>"

TOOLS_TEMPLATE = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools "
    f"by writing a \"{CALLS_OPEN}\" block like the following:\n\n"
    f"{CALLS_OPEN}\n"
    f"{INVOKE_OPEN} name=\"$TOOL_NAME\">\n"
    f"{PARAM_OPEN} name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE{PARAM_CLOSE}\n"
    f"...\n{INVOKE_CLOSE}\n{INVOKE_OPEN} name=\"$TOOL_NAME2\">\n"
    f"...\n{INVOKE_CLOSE}\n{CALLS_CLOSE}\n\n"
    "String parameters should be specified as is and set `string=\"true\"`. For all other types "
    "(numbers, booleans, arrays, objects), pass the value in JSON format and set "
    "`string=\"false\"`.\n\n"
    f"If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete "
    f"reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.\n\n"
    f"Otherwise, output directly after {THINK_END} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    "{schemas}\n\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool "
    "calls.\n"
)


class _Part(NamedTuple):
    """One piece of a user turn: plain text, or a tool result with the call id it answers."""
    text: str
    is_tool_result: bool = False
    call_id: str | None = None


def resolve_reasoning_effort(effort=None) -> int:
    """Map `reasoning_effort` (None, "low"/"high"/"max" or an int 1-100) to the rendered N."""
    if effort is None:
        effort = DEFAULT_REASONING_EFFORT
    if isinstance(effort, str):
        if effort not in REASONING_EFFORT_ALIASES:
            raise ValueError(f"reasoning_effort {effort!r} is not one of 'low', 'high', 'max' "
                             "or an integer 1-100")
        return REASONING_EFFORT_ALIASES[effort]
    if isinstance(effort, bool) or not isinstance(effort, numbers.Integral):
        raise ValueError(f"reasoning_effort must be an int 1-100 or 'low'/'high'/'max', "
                         f"got {type(effort).__name__} {effort!r}")
    if not 1 <= effort <= 100:
        raise ValueError(f"reasoning_effort {effort} is outside the range 1-100")
    return int(effort)


def check_thinking_mode(thinking_mode):
    if thinking_mode not in THINKING_MODES:
        raise ValueError(f"thinking_mode {thinking_mode!r} is not 'chat' or 'thinking'")


def _check_no_placeholder(text, where):
    if isinstance(text, str) and IMAGE_PLACEHOLDER in text:
        raise ValueError(f"{where}: text contains the literal image placeholder "
                         f"{IMAGE_PLACEHOLDER}; pass images as separate content blocks")


def _plain_text(content, where):
    """Content of a system/assistant/reminder message; a list may hold text blocks only."""
    if content is None:
        return ""
    if isinstance(content, list):
        for block in content:
            if not (isinstance(block, dict) and block.get("type") == "text"):
                raise ValueError(f"{where}: only text blocks are allowed in this message's content")
        content = "\n\n".join(block.get("text") or "" for block in content)
    if not isinstance(content, str):
        raise ValueError(f"{where}: content must be a string or a list of blocks, "
                         f"got {type(content).__name__}")
    _check_no_placeholder(content, where)
    return content


def _block_text(block, where, images):
    """One content block of a user or tool message as text; images become the placeholder."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind == "text":
        return _plain_text(block.get("text"), where)
    if kind in IMAGE_BLOCK_TYPES:
        images.append(block)
        return IMAGE_PLACEHOLDER
    return f"[Unsupported {kind}]"


def _user_parts(content, where, images):
    """Content of a user message as parts (text, images, embedded tool_result blocks)."""
    if not isinstance(content, list):
        return [_Part(_plain_text(content, where))]
    parts = []
    for k, block in enumerate(content):
        if isinstance(block, dict) and block.get("type") == "tool_result":
            parts.append(_tool_part(block.get("content"), block.get("tool_use_id"),
                                    f"{where}.content[{k}]", images))
        else:
            parts.append(_Part(_block_text(block, f"{where}.content[{k}]", images)))
    return parts


def _tool_part(content, call_id, where, images):
    """A tool result; list content is joined like user blocks."""
    if not isinstance(content, list):
        return _Part(_plain_text(content, where), is_tool_result=True, call_id=call_id)
    text = "\n\n".join(_block_text(b, f"{where}[{k}]", images) for k, b in enumerate(content))
    return _Part(text, is_tool_result=True, call_id=call_id)


def _check_fields(message, role, where):
    """Field checks beyond the role: task name, where tools may sit, list-valued fields."""
    task = message.get("task")
    if task is not None and task not in TASK_TOKENS:
        raise ValueError(f"{where}: unknown task {task!r}; "
                         f"expected one of {', '.join(TASK_TOKENS)}")
    if message.get("tools") and role != "system":
        raise ValueError(f"{where}: tools are rendered only in a system message, not in {role!r}")
    for key in ("tools", "tool_calls"):
        if message.get(key) and not isinstance(message[key], list):
            raise ValueError(f"{where}: {key} must be a list, got {type(message[key]).__name__}")
    _check_no_placeholder(message.get("reasoning_content"), where)


def _normalize(message, where, images):
    """Validate one message and convert user/tool content into `_parts`."""
    if not isinstance(message, dict):
        raise ValueError(f"{where}: a message must be a dict, got {type(message).__name__}")
    role = message.get("role")
    if role not in ROLES:
        raise ValueError(f"{where}: unknown role {role!r}; expected one of {', '.join(ROLES)}")
    _check_fields(message, role, where)
    out = dict(message, _where=where)
    if role == "user":
        out["_parts"] = _user_parts(message.get("content"), where, images)
    elif role == "tool":
        out["_parts"] = [_tool_part(message.get("content"), message.get("tool_call_id"), where,
                                    images)]
    else:
        out["content"] = _plain_text(message.get("content"), where)
    return out


def _merge_user_turns(messages):
    """Fold tool results and consecutive user messages into one user turn."""
    merged = []
    for message in messages:
        previous = merged[-1] if merged else {}
        is_user = message["role"] in ("user", "tool")
        if is_user and previous.get("role") == "user" and previous.get("task") is None:
            previous["_parts"] = previous["_parts"] + message["_parts"]
            previous["task"] = message.get("task")
        else:
            merged.append(dict(message, role="user") if is_user else message)
    return merged


def _reorder_results(parts, order):
    """Put the tool results of one turn in call order; other parts keep their slots."""
    results = [p for p in parts if p.is_tool_result]
    for part in results:
        if part.call_id and part.call_id not in order:
            raise ValueError(f"tool result for call id {part.call_id!r} answers no tool call of "
                             "the preceding assistant message")
    ordered = iter(sorted(results, key=lambda p: order.get(p.call_id, 0)))
    return [next(ordered) if p.is_tool_result else p for p in parts]


def _sort_tool_results(turns):
    """Order tool results by the call ids of the assistant message just before them."""
    order = {}
    for turn in turns:
        if turn["role"] == "assistant":
            calls = [call for call in turn.get("tool_calls") or [] if isinstance(call, dict)]
            ids = [call.get("id") for call in calls]
            order = {call_id: k for k, call_id in enumerate(ids) if call_id}
        elif turn["role"] == "user" and order:
            turn["_parts"] = _reorder_results(turn["_parts"], order)


def _prepare(context, messages, images):
    """Normalized, merged turns of context + messages, and the index where new turns start."""
    history = [_normalize(m, f"context[{k}]", []) for k, m in enumerate(context)]
    new = [_normalize(m, f"messages[{k}]", images) for k, m in enumerate(messages)]
    history, new = _merge_user_turns(history), _merge_user_turns(new)
    turns = history + new
    _sort_tool_results(turns)
    return turns, len(history)


def _last_user_index(turns):
    """Last user turn, or last system message after index 0; -1 if none."""
    for index in range(len(turns) - 1, -1, -1):
        role = turns[index]["role"]
        if role == "user" or (role == "system" and index > 0):
            return index
    return -1


def render_tools(tools, where="tools") -> str:
    """The `## Tools` block of a system message: instructions plus one JSON schema per line."""
    schemas = []
    for k, tool in enumerate(tools):
        if not (isinstance(tool, dict) and isinstance(tool.get("function"), dict)):
            raise ValueError(f"{where}[{k}] must be an OpenAI tool dict with a 'function' object")
        schemas.append(json.dumps(tool["function"], ensure_ascii=False))
    return TOOLS_TEMPLATE.replace("{schemas}", "\n".join(schemas))


def _call_arguments(function, where):
    """Tool-call arguments as a dict; a JSON string is decoded first."""
    arguments = function.get("arguments")
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: arguments are not valid JSON ({error})") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"{where}: arguments must be a JSON object, "
                         f"got {type(arguments).__name__}")
    return arguments


def _render_parameter(key, value):
    is_string = isinstance(value, str)
    text = value if is_string else json.dumps(value, ensure_ascii=False)
    flag = "true" if is_string else "false"
    return f'{PARAM_OPEN} name="{key}" string="{flag}">{text}{PARAM_CLOSE}'


def _render_invoke(call, where):
    function = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where}: a tool call needs a function name")
    arguments = _call_arguments(function, where)
    params = "\n".join(_render_parameter(key, value) for key, value in arguments.items())
    return f'{INVOKE_OPEN} name="{function["name"]}">\n{params}\n{INVOKE_CLOSE}'


def render_tool_calls(tool_calls, where="tool_calls") -> str:
    """The DSML block appended to an assistant turn (with its leading blank line)."""
    if not tool_calls:
        return ""
    invokes = [_render_invoke(call, f"{where}[{k}]") for k, call in enumerate(tool_calls)]
    return f"\n\n{CALLS_OPEN}\n" + "\n".join(invokes) + f"\n{CALLS_CLOSE}"


class _Render(NamedTuple):
    """Conversation-wide settings every turn renderer needs."""
    turns: list
    is_thinking: bool
    drop_thinking: bool
    last_user: int
    effort: int


def _render_prefix(r):
    """Opening of the conversation at message 0: `<｜System｜>` and the effort line."""
    if r.is_thinking:
        return SYSTEM + EFFORT_LINE.format(r.effort)
    return SYSTEM if r.turns[0]["role"] == "system" else ""


def _render_system(r, index):
    message = r.turns[index]
    out = (SYSTEM if index > 0 else "") + message["content"]
    if message.get("tools"):
        out += "\n\n" + render_tools(message["tools"], f"{message['_where']}.tools")
    if message.get("response_format"):
        out += RESPONSE_FORMAT_HEAD + json.dumps(message["response_format"], ensure_ascii=False)
    return out


def _render_user(r, index):
    parts = r.turns[index]["_parts"]
    texts = [f"<tool_result>{p.text}</tool_result>" if p.is_tool_result else p.text for p in parts]
    return USER + "\n\n".join(texts)


def _render_assistant(r, index):
    message = r.turns[index]
    after_task = index > 0 and r.turns[index - 1].get("task") is not None
    keeps_reasoning = not r.drop_thinking or index > r.last_user
    reasoning = ""
    if r.is_thinking and not after_task and keeps_reasoning:
        reasoning = (message.get("reasoning_content") or "") + THINK_END
    calls = render_tool_calls(message.get("tool_calls"), f"{message['_where']}.tool_calls")
    return reasoning + message["content"] + calls + ("" if message.get("wo_eos") else EOS)


def _render_suffix(r, index):
    """Generation header or task token after a turn the model answers."""
    following = r.turns[index + 1]["role"] if index + 1 < len(r.turns) else None
    if following not in (None, "assistant", "latest_reminder"):
        return ""
    message = r.turns[index]
    task = message.get("task")
    if task == "action":
        return ASSISTANT + (THINK_START if r.is_thinking else THINK_END) + TASK_TOKENS[task]
    if task is not None:
        return TASK_TOKENS[task]
    if message["role"] == "user" or (message["role"] == "system" and index > 0):
        is_open = r.is_thinking and (not r.drop_thinking or index >= r.last_user)
        return ASSISTANT + (THINK_START if is_open else THINK_END)
    return ""


_RENDERERS = {"system": _render_system, "user": _render_user, "assistant": _render_assistant,
              "latest_reminder": lambda r, index: LATEST_REMINDER + r.turns[index]["content"]}


def encode_messages(messages, thinking_mode="chat", reasoning_effort=None, context=None,
                    drop_thinking=True) -> str:
    """Render OpenAI-style messages into the exact prompt string to tokenize.

    Args:
        messages: dicts with `role` in system/user/assistant/tool/latest_reminder and the fields
            the official encoder reads: content (str or blocks: text, image/image_url, tool_result),
            reasoning_content, tools, response_format, tool_calls, tool_call_id, task, wo_eos.
        thinking_mode: "chat" (header ends `</think>`) or "thinking" (header ends `<think>`).
        reasoning_effort: None (= "high"), "low"/"high"/"max" or an int 1-100; rendered only in
            thinking mode at message 0.
        context: messages already rendered earlier; when non-empty, only `messages` are rendered
            and no BOS is emitted, so the result appends to the cached prompt.
        drop_thinking: drop reasoning of assistant turns before the last user turn (thinking mode);
            forced off when any message carries tools.

    Returns:
        The prompt text. It contains the BOS text itself: tokenize without special tokens.

    Raises:
        ValueError: naming the offending message or option.
    """
    check_thinking_mode(thinking_mode)
    effort = resolve_reasoning_effort(reasoning_effort)
    context = list(context or [])
    turns, start = _prepare(context, list(messages), [])
    has_tools = any(isinstance(m, dict) and m.get("tools") for m in context + list(messages))
    drop = drop_thinking and not has_tools
    r = _Render(turns, thinking_mode == "thinking", drop, _last_user_index(turns), effort)
    out = [] if start > 0 else [BOS]
    for index in range(start, len(turns)):
        if index == 0:
            out.append(_render_prefix(r))
        out.append(_RENDERERS[turns[index]["role"]](r, index))
        out.append(_render_suffix(r, index))
    return "".join(out)


def collect_images(messages) -> list:
    """Image blocks of `messages` in prompt order, one per `<｜deepseek_image｜>` placeholder."""
    images = []
    _prepare([], list(messages), images)
    return images
