"""The server's parts without HTTP: the streaming reply parser against `parse_completion` on
the official vectors (any split), stop strings, request mapping (thinking, tools, images), the
prompt-cache LRU (bytes bound, longest prefix, copies), and the CLI's flags and errors."""

from __future__ import annotations

import base64
import io
import json
import os
import random
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mlx_v41.cache import cache_bytes
from mlx_v41.chat import format as cf
from mlx_v41.chat.completion import parse_completion
from mlx_v41.chat.format import encode_messages
from mlx_v41.cli import server as cli
from mlx_v41.generation.api import prefill
from mlx_v41.generation.prompt_reuse import PromptCache
from mlx_v41.model.config import VisionConfig
from mlx_v41.server.engine import StopStrings
from mlx_v41.server.images import ImageReader
from mlx_v41.server.conversation import thinking_mode
from mlx_v41.server.openai.messages import allows_tool_calls, chat_messages, tool_choice
from mlx_v41.server.engine.batch import BatchEngine
from mlx_v41.server.engine.prompt_store import PromptCacheStore, align_to_tokens
from mlx_v41.server.errors import RequestError
from mlx_v41.server.openai.protocol import ChatCompletionRequest, parse_body
from mlx_v41.server.reply_parser import Reply, ReplyParser, parse_reply
from server_harness import tiny

VECTORS = json.loads((Path(__file__).parent / "data" / "chat_vectors.json").read_text("utf-8"))


def vector_completions() -> list:
    """(text, mode) of every assistant turn of the official vectors that is the last turn's
    reply, as the model would have generated it (EOS included)."""
    out = []
    for case in VECTORS["cases"]:
        messages, mode = case["messages"], case["thinking_mode"]
        for k, message in enumerate(messages):
            if message["role"] != "assistant" or message.get("wo_eos"):
                continue
            head = encode_messages(messages[:k], mode, case["reasoning_effort"])
            full = encode_messages(messages[:k + 1], mode, case["reasoning_effort"])
            if full.startswith(head) and head.endswith((cf.THINK_START, cf.THINK_END)):
                out.append((full[len(head):], mode))
    return out


HANDMADE = [
    ("Plain answer\n\nwith a blank line.", "chat"),
    ("Let me see.</think>Two calls:\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"a\">\n"
     "<｜DSML｜ parameter name=\"q\" string=\"false\">{\"k\": [1, 2]}</｜DSML｜ parameter>\n"
     "<｜DSML｜ parameter name=\"s\" string=\"true\">x \"y\"</｜DSML｜ parameter>\n"
     "</｜DSML｜ invoke>\n<｜DSML｜ invoke name=\"b\">\n</｜DSML｜ invoke>\n</｜DSML｜ calls>",
     "thinking"),
    ("ends with newlines\n\n\n", "chat"),
]


def split_randomly(text: str, seed: int) -> list:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 40))))
    return [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("text, mode", vector_completions() + HANDMADE)
def test_reply_parser_equals_parse_completion_at_any_split(text, mode):
    text = text.removesuffix(cf.EOS)
    expected = parse_completion(text + cf.EOS, mode)
    calls = [call["function"] for call in expected["tool_calls"]]
    for seed in range(25):
        parser, reply = ReplyParser(mode == "thinking"), Reply()
        for part in split_randomly(text, seed):
            reply.add(parser.feed(part))
        reply.add(parser.finish())
        assert (reply.reasoning, reply.content, reply.calls) == \
            (expected["reasoning_content"], expected["content"], calls), seed


def test_vectors_hold_tool_calls():
    assert sum(cf.CALLS_OPEN in text for text, _ in vector_completions()) >= 1


def test_arguments_stream_a_parameter_at_a_time():
    text = HANDMADE[1][0]
    parser = ReplyParser(True)
    deltas = [d for ch in text for d in parser.feed(ch)] + parser.finish()
    kinds = [(d.kind, d.index, d.closes) for d in deltas if d.kind in ("call", "arguments")]
    assert kinds == [("call", 0, False), ("arguments", 0, False), ("arguments", 0, False),
                     ("arguments", 0, True), ("call", 1, False), ("arguments", 1, True)]


def test_the_arguments_that_close_a_call_say_so():
    """The last arguments delta of a call is marked `closes`, also where a malformed block
    closes the open call's JSON (what Ollama's stream waits for to send a call whole)."""
    text = "Hi\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"f\">\n<｜DSML｜ param"
    parser = ReplyParser(False)
    deltas = parser.feed(text) + parser.finish()
    arguments = [d for d in deltas if d.kind == "arguments"]
    assert [(d.text, d.closes) for d in arguments] == [("{}", True)]


@pytest.mark.parametrize("text, content", [
    # The block never closes (max_tokens): the open call's JSON is closed, the rest is text.
    ("Hi\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"f\">\n<｜DSML｜ param", "\n<｜DSML｜ param"),
    # Not DSML after the opener: the whole block is content.
    ("Hi\n\n<｜DSML｜ calls>\nnonsense", "Hi\n\n<｜DSML｜ calls>\nnonsense"),
])
def test_malformed_or_unfinished_blocks_become_content(text, content):
    reply = parse_reply(text, thinking=False)
    assert reply.content.endswith(content)
    for call in reply.calls:
        json.loads(call["arguments"])


def test_unfinished_reasoning_stays_reasoning():
    reply = parse_reply("still thinking </thi", thinking=True)
    assert (reply.reasoning, reply.content) == ("still thinking </thi", "")


def test_stop_strings_across_tokens():
    stops = StopStrings(["END", "##"])
    assert stops.feed("abc E") == ("abc ", False)
    assert stops.feed("N") == ("", False)
    assert stops.feed("D tail") == ("", True)
    other = StopStrings(["END"])
    assert other.feed("xE") == ("x", False) and other.feed("y") == ("Ey", False)
    assert other.pending == ""


def chat_request(**fields) -> ChatCompletionRequest:
    return parse_body(ChatCompletionRequest,
                      {"messages": [{"role": "user", "content": "hi"}], **fields})


@pytest.mark.parametrize("fields, expected", [
    ({}, (True, None)),
    ({"chat_template_kwargs": {"thinking": False}}, (False, None)),
    ({"chat_template_kwargs": {"enable_thinking": False}}, (False, None)),
    ({"reasoning_effort": "none"}, (False, None)),
    ({"reasoning_effort": "medium"}, (True, "high")),
    ({"reasoning_effort": "xhigh"}, (True, "max")),
    ({"reasoning_effort": 30, "chat_template_kwargs": {"thinking": True}}, (True, 30)),
])
def test_thinking_switches(fields, expected):
    assert thinking_mode(chat_request(**fields), True, None) == expected


def test_reasoning_effort_alone_turns_thinking_on():
    assert thinking_mode(chat_request(reasoning_effort="low"), False, None) == (True, "low")


def test_messages_map_to_the_chat_format():
    body = parse_body(ChatCompletionRequest, {"messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "reasoning": "r", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"}]})
    assert chat_messages(body, system_prompt="ignored: there is one") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "reasoning_content": "r", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"}]
    assert chat_messages(chat_request(), "S")[0] == {"role": "system", "content": "S"}


def test_tool_choice_and_unsupported_parts():
    assert allows_tool_calls(chat_request()) and not allows_tool_calls(
        chat_request(tool_choice="none"))
    assert tool_choice(chat_request(tool_choice="required")) == ("required", None)
    assert tool_choice(chat_request(tool_choice={"type": "function", "function": {
        "name": "f"}})) == ("required", "f")
    with pytest.raises(RequestError, match="tool_choice must be 'auto', 'none', 'required'"):
        allows_tool_calls(chat_request(tool_choice={"type": "function"}))
    with pytest.raises(RequestError, match=r"messages\[0\].content\[0\]: content part type "
                                           r"'input_audio'"):
        chat_messages(parse_body(ChatCompletionRequest, {"messages": [
            {"role": "user", "content": [{"type": "input_audio"}]}]}))


def test_image_parts_become_chat_image_blocks():
    """Decoded RGB images in the chat format's blocks, in order; without a reader (a model
    without the tower) every image part is refused by name."""
    pixels = np.zeros((30, 40, 4), np.uint8)
    pixels[..., 0], pixels[..., 3] = 200, 255
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGBA").save(buffer, format="PNG")
    uri = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    body = parse_body(ChatCompletionRequest, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": uri}},
        {"type": "image", "image": uri}]}]})
    content = chat_messages(body, images=ImageReader(VisionConfig()))[0]["content"]
    assert content[0] == {"type": "text", "text": "a"}
    for block in content[1:]:
        assert block["type"] == "image" and block["image"].mode == "RGB"
        assert block["image"].size == (40, 30) and block["image"].getpixel((3, 3)) == (200, 0, 0)
    assert cf.collect_images([{"role": "user", "content": content}]) == content[1:]
    with pytest.raises(RequestError, match=r"^messages\[0\]\.content\[1\]: image input needs "
                                           "the vision tower, but the model has no vision"):
        chat_messages(body)


@pytest.mark.parametrize("kind", ["JPEG", "WEBP", "GIF", "BMP"])
def test_image_formats(kind):
    buffer = io.BytesIO()
    Image.new("RGB", (40, 30), (10, 200, 30)).save(buffer, format=kind)
    uri = f"data:image/{kind.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()
    body = parse_body(ChatCompletionRequest, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": uri}]}]})
    [block] = chat_messages(body, images=ImageReader(VisionConfig()))[0]["content"]
    assert block["image"].size == (40, 30) and block["image"].mode == "RGB"


# ----------------------------------------------------------------------------- prompt store

def state_for(model, tokenizer, text: str) -> PromptCache:
    ids = tokenizer.encode_prompt(text)
    state = PromptCache(model.make_cache(), list(ids))
    prefill(model, ids, state.cache)
    return state


def test_store_keeps_the_longest_usable_prefix_and_hands_out_copies():
    model, tokenizer = tiny()
    store = PromptCacheStore(model, 1 << 30)
    a = state_for(model, tokenizer, "The quick brown fox")
    store.insert(a)
    prompt = tokenizer.encode_prompt("The quick brown fox jumps")
    got = store.fetch(prompt)
    assert got.tokens == a.tokens and got.cache is not a.cache
    prefill(model, prompt[len(got.tokens):], got.cache)
    assert store.entries[0].state.cache[0].offset == len(a.tokens)  # the stored one unchanged
    assert store.fetch(tokenizer.encode_prompt("Nothing alike")).tokens[1:] == []


def test_store_is_bounded_in_bytes_least_recently_used_first():
    model, tokenizer = tiny()
    states = [state_for(model, tokenizer, f"prompt number {k} " * 3) for k in range(3)]
    one = max(cache_bytes(s.cache)["total"] for s in states)
    store = PromptCacheStore(model, 2 * one + one // 2)
    store.insert(states[0])
    store.insert(states[1])
    store.fetch(states[0].tokens)  # 0 used last: 1 goes first
    store.insert(states[2])
    assert [e.state for e in store.entries] == [states[0], states[2]]
    assert store.nbytes <= store.max_bytes
    assert PromptCacheStore(model, one - 1).insert(states[0]) is None  # alone over the bound


def test_store_drops_an_entry_the_new_one_covers():
    model, tokenizer = tiny()
    store = PromptCacheStore(model, 1 << 30)
    short = state_for(model, tokenizer, "Hello there")
    store.insert(short)
    longer = short.copy()
    extra = tokenizer.encode(" friend", add_special_tokens=False)
    prefill(model, extra, longer.cache)
    longer.tokens += extra
    store.insert(longer)
    assert [e.state for e in store.entries] == [longer]
    assert store.insert(short) is None  # covered by `longer`: not kept twice


def test_a_store_applying_another_stores_decisions_ends_alike():
    """Across ranks rank 0's store decides, counting each cache at its largest share, and the
    others apply the decisions to their own caches: they hold the same keys, and their
    `take` of rank 0's choice holds the same tokens. Deciding by its own (smaller) bytes the
    follower would keep more (the ranks would then reuse different prefixes)."""
    model, tokenizer = tiny()
    states = [state_for(model, tokenizer, f"prompt number {k} " * 3) for k in range(4)]
    one = max(cache_bytes(s.cache)["total"] for s in states)
    leader = PromptCacheStore(model, 2 * one)
    follower, alone = PromptCacheStore(model, 2 * one), PromptCacheStore(model, 2 * one)
    for k, state in enumerate(states):
        choice = leader.choose(state.tokens)
        assert follower.take(choice).tokens == leader.take(choice).tokens
        decision = leader.admit(state, one - k)  # the largest share, counted on rank 0
        leader.apply(state, decision)
        follower.apply(state.copy(), json.loads(json.dumps(decision)))
        alone.apply(state, alone.admit(state, one // 3))  # its own smaller share
    assert [e.key for e in follower.entries] == [e.key for e in leader.entries]
    assert [e.state.tokens for e in leader.entries] == [s.tokens for s in states[2:]]
    assert len(alone.entries) == 4


class ShareLink:
    """`Link.all_gather` of a group whose other ranks hold `others` (one list per rank)."""

    def __init__(self, *others):
        self.others, self.size = others, len(others) + 1

    def all_gather(self, x, what):
        import mlx.core as mx

        return mx.concatenate([x, *(mx.array(o, mx.int32) for o in self.others)])


def test_largest_shares_over_the_ranks():
    from mlx_v41.server.engine.ranks import largest_shares

    model, tokenizer = tiny()
    state = state_for(model, tokenizer, "a cached prompt")
    mine = cache_bytes(state.cache)["total"]
    big = 5 * 2**31 + 7  # over an int32: travels as two
    assert largest_shares(ShareLink([0, 100, big >> 31, big & 0x7FFFFFFF]),
                          [state, state]) == [mine, big]
    assert largest_shares(ShareLink([-1, 0, 0, 1]), [state, None]) == [None, None]


def test_align_trims_drafts_a_stream_fed_but_did_not_yield():
    model, tokenizer = tiny()
    state = state_for(model, tokenizer, "drafts were fed to the cache but never yielded")
    state.tokens = state.tokens[:-3]
    assert align_to_tokens(state) and state.cache[0].offset == len(state.tokens)
    state.tokens = state.tokens[:1]
    assert not align_to_tokens(state)  # more than the exact rollback


# ----------------------------------------------------------------------------- CLI

@pytest.mark.parametrize("text, value", [("4G", 4 * 10**9), ("512MiB", 512 * 2**20),
                                         ("0", 0), ("1.5K", 1500)])
def test_sizes(text, value):
    assert cli.parse_size(text) == value


def test_flags_default_to_loopback_and_refuse_bad_values(capsys):
    args = cli.setup_arg_parser().parse_args(["--model", "demo"])
    assert (args.host, args.port, args.max_tokens, args.prompt_cache_dir) == \
        ("127.0.0.1", 8080, 512, None)
    assert args.max_image_bytes == 20 * 10**6  # OpenAI's per-image limit
    assert cli.setup_arg_parser().parse_args(["--model", "x", "--max-image-bytes", "5MB"]
                                             ).max_image_bytes == 5 * 10**6
    with pytest.raises(SystemExit):
        cli.setup_arg_parser().parse_args(["--model", "x", "--prompt-cache-bytes", "lots"])
    assert "'lots' is not a size" in capsys.readouterr().err


def test_decode_prefill_budget_flag_reaches_the_batch_generator(capsys):
    def parsed(*flags):
        return cli.setup_arg_parser().parse_args(["--model", "x", *flags]).decode_prefill_budget
    assert (parsed(), parsed("--decode-prefill-budget", "off"),
            parsed("--decode-prefill-budget", "96")) == ("auto", None, 96)
    for bad in ("0", "lots"):
        with pytest.raises(SystemExit):
            parsed("--decode-prefill-budget", bad)
        assert f"{bad!r} is not auto, off or a positive integer" in capsys.readouterr().err
    model, tokenizer = tiny()
    for budget, fixed in (("auto", None), (96, 96)):
        engine = BatchEngine(model, tokenizer, PromptCacheStore(model, 0),
                             decode_prefill_budget=budget)
        assert engine.generator.pacer.fixed == fixed
    engine = BatchEngine(model, tokenizer, PromptCacheStore(model, 0), decode_prefill_budget=None)
    assert engine.generator.pacer is None  # the one-chunk-a-step schedule


@pytest.mark.parametrize("text", ["1e999", "-1", "nan"])
def test_sizes_refuse_what_is_not_one(capsys, text):
    with pytest.raises(SystemExit):
        cli.setup_arg_parser().parse_args(["--model", "x", "--prompt-cache-bytes", text])
    assert f"{text!r} is not a size" in capsys.readouterr().err


def test_a_prompt_cache_dir_the_server_cannot_write_is_refused(capsys, tmp_path, monkeypatch):
    """At startup, before the model loads: one line naming the flag and the path."""
    (tmp_path / "file").write_text("")
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != locked and real_access(p, mode))
    for path, words in ((tmp_path / "file", f"'{tmp_path / 'file'}' is a file, not a folder"),
                        (tmp_path / "file" / "sub",
                         f"'{tmp_path / 'file' / 'sub'}': {tmp_path / 'file'} is a file"),
                        (locked, f"'{locked}' is not writable"),
                        (locked / "new", f"'{locked / 'new'}': {locked} is not writable")):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["--model", "/nonexistent/model", "--prompt-cache-dir", str(path)])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.count("\n") == 1, err
        assert f"error: argument --prompt-cache-dir: {words}" in err, err
    new = tmp_path / "new" / "prompts"  # made when the server starts
    args = cli.setup_arg_parser().parse_args(["--model", "x", "--prompt-cache-dir", str(new)])
    assert args.prompt_cache_dir == str(new) and not (tmp_path / "new").exists()


def test_missing_model_is_one_line(capsys, tmp_path):
    assert cli.main(["--model", str(tmp_path / "none")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model folder not found" in err


def test_console_script_and_dispatch(capsys):
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    section = lambda name: text.split(f"[{name}]")[1].split("\n[")[0]  # noqa: E731
    scripts = dict(re.findall(r'"([^"]+)"\s*=\s*"([^"]+)"', section("project.scripts")))
    assert scripts["mlx_v41.server"] == "mlx_v41.cli.server:main"
    assert '"mlx_v41.server"' in section("tool.setuptools")
    assert '"fastapi>=' in section("project") and '"uvicorn>=' in section("project")
    from mlx_v41.__main__ import main as dispatch

    with pytest.raises(SystemExit) as exit_info:
        dispatch(["server", "--help"])
    assert exit_info.value.code == 0 and "--prompt-cache-dir" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (["--pipeline"], "--pipeline needs two or more processes: start them with mlx.launch"),
    (["--tensor-parallel", "--prompt-cache-dir", "cache"],
     "--tensor-parallel needs two or more processes")])
def test_distributed_flags_without_a_group_are_one_line(flags, message, capsys):
    """Bad distributed flags end in one line before any model is loaded (the folder does not
    exist); a real group is tested in tests/test_distributed.py."""
    assert cli.main(["--model", "/nonexistent/model", *flags]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"mlx_v41.server: error: {message}" in err, err


def test_a_job_ended_by_the_server_keeps_its_first_reason():
    """A request the drain ended ("not started") keeps that reason when the grace runs out
    before its next chunk (`end_all` aborts it again): the client hears the first."""
    import asyncio

    from mlx_v41.server.engine.serial import EngineClosed, Finish, Job

    loop = asyncio.new_event_loop()
    try:
        job = Job(None, None, loop)
        job.abort(EngineClosed("the server is shutting down: the request was not started"))
        job.abort(EngineClosed("the server shut down before the reply finished"))
        job.put(Finish("cancelled", 3, 0, 0))
        item = loop.run_until_complete(job.queue.get())
    finally:
        loop.close()
    assert isinstance(item, EngineClosed) and "was not started" in str(item)


def test_top_p_zero_is_greedy_whatever_the_temperature():
    """Every API's route resolves its sampling through `ServerConfig.settings`: a top_p of 0
    (the request's, or the server's when the request leaves it out) keeps the most likely
    token alone, so the temperature becomes 0; any other top_p keeps it."""
    from mlx_v41.server import ServerConfig

    config = ServerConfig(model_id="tiny", temp=0.7, top_p=1.0)
    assert config.settings(temp=1.5, top_p=0).temp == 0.0
    assert config.settings(top_p=0.0).temp == 0.0
    assert config.settings(temp=1.5, top_p=0.5).temp == 1.5
    assert config.settings().temp == 0.7
    assert ServerConfig(model_id="tiny", temp=0.7, top_p=0).settings(temp=1.2).temp == 0.0
