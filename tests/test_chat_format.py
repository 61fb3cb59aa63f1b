"""Chat format: official vectors byte-identical, input errors, effort aliases, parse round trips."""

import json
from pathlib import Path

import pytest

from mlx_v41.chat import format as cf
from mlx_v41.chat.completion import parse_completion
from mlx_v41.chat.format import ASSISTANT, EOS, THINK_END, THINK_START, USER, encode_messages

VECTORS = json.loads((Path(__file__).parent / "data" / "chat_vectors.json").read_text("utf-8"))
CASES = {case["name"]: case for case in VECTORS["cases"]}

WEATHER_CALL = {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}
TIME_CALL = {"id": "call_2", "type": "function",
             "function": {"name": "get_time", "arguments": {"zone": "CET"}}}


def render(case):
    options = case.get("options", {})
    return encode_messages(case["messages"], case["thinking_mode"], case["reasoning_effort"],
                           **options)


def completion_of(messages, thinking_mode, **options):
    """The text after the last generation header: what the model generated for the last turn."""
    head = encode_messages(messages[:-1], thinking_mode, **options)
    full = encode_messages(messages, thinking_mode, **options)
    assert full.startswith(head)
    return full[len(head):]


# ----------------------------------------------------------------------------- vectors

def test_vector_file_is_complete():
    assert len(CASES) == 18


@pytest.mark.parametrize("name", sorted(CASES))
def test_vector_renders_byte_identically(name):
    assert render(CASES[name]) == CASES[name]["prompt"]


def test_special_token_code_points():
    assert cf.BOS == "<\uff5cbegin\u2581of\u2581sentence\uff5c>"
    assert cf.EOS == "<\uff5cend\u2581of\u2581sentence\uff5c>"
    assert cf.DSML == "\uff5cDSML\uff5c"
    assert cf.SPECIAL_TOKEN_IDS[cf.EOS] == cf.EOS_ID == 1 and cf.END_OF_TURN_TOKENS == (1,)
    assert cf.SPECIAL_TOKEN_IDS[cf.IMAGE_PLACEHOLDER] == cf.IMAGE_TOKEN_ID == 129264
    assert len(set(cf.SPECIAL_TOKEN_IDS.values())) == len(cf.SPECIAL_TOKEN_IDS)


# ----------------------------------------------------------------------------- reasoning effort

@pytest.mark.parametrize("alias, value", [("low", 50), ("high", 75), ("max", 100), (None, 75)])
def test_effort_aliases(alias, value):
    assert cf.resolve_reasoning_effort(alias) == value
    prompt = encode_messages([{"role": "user", "content": "Hi"}], "thinking", alias)
    assert f"Reasoning Effort: {value} (range" in prompt


def test_effort_integers_render_verbatim():
    for effort in range(1, 101):
        prompt = encode_messages([{"role": "user", "content": "Hi"}], "thinking", effort)
        assert prompt.startswith(f"{cf.BOS}{cf.SYSTEM}Reasoning Effort: {effort} (range 1-100")


@pytest.mark.parametrize("effort, culprit", [
    (0, "0"), (101, "101"), (-5, "-5"), ("medium", "'medium'"), ("xhigh", "'xhigh'"),
    ("75", "'75'"), ("HIGH", "'HIGH'"), (75.0, "float"), (True, "bool"), ([75], "list"),
])
def test_bad_effort_raises(effort, culprit):
    with pytest.raises(ValueError, match="reasoning_effort") as error:
        encode_messages([{"role": "user", "content": "Hi"}], "thinking", effort)
    assert culprit in str(error.value)
    with pytest.raises(ValueError, match="reasoning_effort"):
        encode_messages([{"role": "user", "content": "Hi"}], "chat", effort)  # checked in chat too


# ----------------------------------------------------------------------------- input errors

@pytest.mark.parametrize("messages, culprit", [
    ([{"role": "robot", "content": "x"}], r"messages\[0\]: unknown role 'robot'"),
    ([{"content": "x"}], r"messages\[0\]: unknown role None"),
    ([{"role": "user", "content": "see <｜deepseek_image｜>"}],
     r"messages\[0\].*image placeholder"),
    ([{"role": "user", "content": [{"type": "text", "text": "a<｜deepseek_image｜>"}]}],
     r"messages\[0\]\.content\[0\].*image placeholder"),
    ([{"role": "user", "content": "Hi"}, {"role": "user", "content": "x", "task": "nap"}],
     r"messages\[1\]: unknown task 'nap'"),
    ([{"role": "user", "content": "Hi", "tools": [{"type": "function", "function": {}}]}],
     r"messages\[0\]: tools are rendered only in a system message"),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": "{oops"}}]}],
     r"messages\[1\]\.tool_calls\[0\]: arguments are not valid JSON"),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": "[1]"}}]}],
     r"messages\[1\]\.tool_calls\[0\]: arguments must be a JSON object"),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "",
                                           "tool_calls": [WEATHER_CALL]},
      {"role": "tool", "tool_call_id": "call_9", "content": "x"}], r"call id 'call_9'"),
    ([{"role": "system", "content": "S", "tools": [{"name": "bare"}]}],
     r"messages\[0\]\.tools\[0\] must be an OpenAI tool"),
    ("not-a-message-list", r"messages\[0\]: a message must be a dict"),
    ([{"role": "user", "content": 42}], r"messages\[0\]: content must be a string"),
])
def test_invalid_messages_raise(messages, culprit):
    with pytest.raises(ValueError, match=culprit):
        encode_messages(messages, "thinking")


def test_context_errors_name_the_context():
    with pytest.raises(ValueError, match=r"context\[1\]: unknown role 'bot'"):
        encode_messages([{"role": "user", "content": "Hi"}], "chat",
                        context=[{"role": "user", "content": "a"}, {"role": "bot"}])


@pytest.mark.parametrize("mode", ["Thinking", "reasoning", None, True])
def test_unknown_thinking_mode_raises(mode):
    with pytest.raises(ValueError, match="thinking_mode"):
        encode_messages([{"role": "user", "content": "Hi"}], mode)
    with pytest.raises(ValueError, match="thinking_mode"):
        parse_completion("x", mode)


# ----------------------------------------------------------------------------- rendering rules

def test_consecutive_user_messages_merge():
    prompt = encode_messages([{"role": "user", "content": "A"}, {"role": "user", "content": "B"}])
    assert prompt == f"{cf.BOS}{USER}A\n\nB{ASSISTANT}{THINK_END}"


def test_tool_results_follow_call_order_and_merge_with_user_text():
    messages = [
        {"role": "user", "content": "Weather and time?"},
        {"role": "assistant", "content": "", "tool_calls": [WEATHER_CALL, TIME_CALL]},
        {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sun"}]},
        {"role": "user", "content": "Thanks"},
    ]
    prompt = encode_messages(messages, "chat")
    results = "<tool_result>sun</tool_result>\n\n<tool_result>12:00</tool_result>"
    tail = f"{EOS}{USER}{results}\n\nThanks"
    assert prompt.endswith(tail + ASSISTANT + THINK_END)


def test_call_order_comes_from_the_assistant_just_before():
    messages = [{"role": "user", "content": "Q"},
                {"role": "assistant", "content": "", "tool_calls": [WEATHER_CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "w"},
                {"role": "assistant", "content": "Done."},
                {"role": "tool", "tool_call_id": "call_7", "content": "late"}]
    prompt = encode_messages(messages)  # no calls to check against: kept as given
    assert prompt.endswith(f"{USER}<tool_result>late</tool_result>{ASSISTANT}{THINK_END}")


def test_tool_results_in_new_messages_use_call_order_from_context():
    context = [{"role": "user", "content": "Q"},
               {"role": "assistant", "content": "", "tool_calls": [WEATHER_CALL, TIME_CALL]}]
    messages = [{"role": "tool", "tool_call_id": "call_2", "content": "t"},
                {"role": "tool", "tool_call_id": "call_1", "content": "w"}]
    prompt = encode_messages(messages, "thinking", context=context)
    assert prompt == (f"{USER}<tool_result>w</tool_result>\n\n<tool_result>t</tool_result>"
                      f"{ASSISTANT}{THINK_START}")


def test_context_continuation_matches_full_render_without_drop():
    history = CASES["thinking_multiturn_keep"]["messages"]
    full = encode_messages(history, "thinking", drop_thinking=False)
    head = encode_messages(history[:2], "thinking", drop_thinking=False)
    tail = encode_messages(history[2:], "thinking", context=history[:2], drop_thinking=False)
    assert head + tail == full


def test_tool_call_rendering_decodes_json_and_keeps_non_ascii():
    block = cf.render_tool_calls([{"function": {"name": "f", "arguments": {
        "s": "naïve\nline", "n": 1.5, "b": True, "o": {"k": [1, None]}}}}])
    d = cf.DSML
    params = [f'<{d} parameter name="s" string="true">naïve\nline</{d} parameter>',
              f'<{d} parameter name="n" string="false">1.5</{d} parameter>',
              f'<{d} parameter name="b" string="false">true</{d} parameter>',
              f'<{d} parameter name="o" string="false">{{"k": [1, null]}}</{d} parameter>']
    assert block == (f'\n\n<{d} calls>\n<{d} invoke name="f">\n' + "\n".join(params)
                     + f"\n</{d} invoke>\n</{d} calls>")


def test_tools_force_drop_thinking_off():
    case = CASES["thinking_tools_roundtrip"]
    messages = case["messages"] + [{"role": "assistant", "reasoning_content": "R2",
                                    "content": "Cloudy, 18 C."},
                                   {"role": "user", "content": "Thanks"}]
    prompt = encode_messages(messages, "thinking")
    assert f"{THINK_START}Need the tool.{THINK_END}" in prompt
    assert f"{THINK_START}R2{THINK_END}Cloudy" in prompt


def test_images_and_unsupported_blocks():
    messages = [{"role": "user", "content": [
        {"type": "image", "url": "a.png"}, {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": "b.png"}}, {"type": "audio"}]}]
    prompt = encode_messages(messages)
    body = "<｜deepseek_image｜>\n\nand\n\n<｜deepseek_image｜>\n\n[Unsupported audio]"
    assert prompt == f"{cf.BOS}{USER}{body}{ASSISTANT}{THINK_END}"
    assert [block.get("url") for block in cf.collect_images(messages)] == ["a.png", None]
    assert cf.collect_images(messages)[1]["image_url"]["url"] == "b.png"


@pytest.mark.parametrize("task, mode, suffix", [
    ("action", "thinking", f"{ASSISTANT}{THINK_START}<｜action｜>"),
    ("action", "chat", f"{ASSISTANT}{THINK_END}<｜action｜>"),
    ("query", "chat", "<｜query｜>"),
    ("read_url", "thinking", "<｜read_url｜>"),
])
def test_task_tokens_replace_the_header(task, mode, suffix):
    prompt = encode_messages([{"role": "user", "content": "x", "task": task}], mode)
    assert prompt.endswith(f"{USER}x{suffix}")


def test_wo_eos_leaves_an_assistant_prefill_open():
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hel", "reasoning_content": "r", "wo_eos": True}]
    assert encode_messages(messages, "thinking").endswith(f"{THINK_START}r{THINK_END}Hel")


def test_reminder_after_last_user_follows_the_header():
    messages = [{"role": "user", "content": "Q"}, {"role": "latest_reminder", "content": "R"}]
    prompt = encode_messages(messages)
    assert prompt.endswith(f"{USER}Q{ASSISTANT}{THINK_END}<｜latest_reminder｜>R")


# ----------------------------------------------------------------------------- parsing

ROUND_TRIP_TURNS = [
    ("thinking", {"role": "assistant", "reasoning_content": "Greet back.", "content": "Hello!"}),
    ("chat", {"role": "assistant", "content": "Hello!\n\nTwo paragraphs."}),
    ("thinking", {"role": "assistant", "reasoning_content": "Need tools.", "content": "",
                  "tool_calls": [WEATHER_CALL, TIME_CALL]}),
    ("chat", {"role": "assistant", "content": "Let me check.\n",
              "tool_calls": [{"type": "function", "function": {
                  "name": "search", "arguments": {"q": "x\n</y>", "opts": {"k": [1, 2.5, None]},
                                                  "flag": False, "café": "ü"}}}]}),
    ("chat", {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "noop", "arguments": "{}"}}]}),
]


def normalized_calls(calls):
    out = []
    for call in calls or []:
        arguments = call["function"]["arguments"]
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
        out.append((call["function"]["name"], arguments))
    return out


@pytest.mark.parametrize("mode, turn", ROUND_TRIP_TURNS)
def test_render_then_parse_round_trip(mode, turn):
    text = completion_of([{"role": "user", "content": "Hi"}, turn], mode)
    parsed = parse_completion(text, mode)
    assert parsed["is_finished"] and parsed["content"] == turn["content"]
    assert parsed["reasoning_content"] == turn.get("reasoning_content", "")
    assert normalized_calls(parsed["tool_calls"]) == normalized_calls(turn.get("tool_calls"))
    again = completion_of([{"role": "user", "content": "Hi"}, parsed], mode)
    assert again == text


def test_parse_the_official_tool_call_vector():
    prompt = CASES["thinking_tools_roundtrip"]["prompt"]
    start = prompt.index(f"{ASSISTANT}{THINK_START}") + len(ASSISTANT + THINK_START)
    parsed = parse_completion(prompt[start:prompt.index(EOS) + len(EOS)], "thinking")
    assert parsed["reasoning_content"] == "Need the tool." and parsed["content"] == ""
    assert normalized_calls(parsed["tool_calls"]) == [("get_weather", {"city": "Paris", "days": 2})]


def test_parse_unfinished_turns():
    assert parse_completion("still thinking", "thinking") == {
        "role": "assistant", "reasoning_content": "still thinking", "content": "",
        "tool_calls": [], "is_finished": False}
    parsed = parse_completion(f"r{THINK_END}partial answer", "thinking")
    assert (parsed["reasoning_content"], parsed["content"], parsed["is_finished"]) == (
        "r", "partial answer", False)


@pytest.mark.parametrize("text, mode, culprit", [
    (f"no close{EOS}", "thinking", "ended without </think>"),
    (f"answer{EOS}more", "chat", "text after"),
    (f"a{USER}b{EOS}", "chat", "special token <｜User｜> inside the parsed content"),
    (f"r{THINK_START}{THINK_END}a{EOS}", "thinking", "inside the parsed reasoning_content"),
    (f"{THINK_END}answer{EOS}", "chat", "inside the parsed content"),
    (f"\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"f\">\n</｜DSML｜ invoke>{EOS}", "chat",
     "malformed DSML tool-call block"),
    (f"\n\n<｜DSML｜ calls>\njunk\n</｜DSML｜ calls>{EOS}", "chat", "malformed DSML invoke"),
    (f"\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"f\">\n<｜DSML｜ parameter name=\"n\" "
     f"string=\"false\">{{bad</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n"
     f"</｜DSML｜ calls>{EOS}",
     "chat", "parameter 'n'"),
    (f"\n\n<｜DSML｜ calls>\n</｜DSML｜ calls>\ntrailing{EOS}", "chat", "followed only by EOS"),
])
def test_parse_errors(text, mode, culprit):
    with pytest.raises(ValueError, match=culprit):
        parse_completion(text, mode)
