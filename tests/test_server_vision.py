"""`mlx_v41.server` with image parts, on the vision golden's checkpoint (spans kept small as in
tests/test_vision_generate.py): replies equal `stream_generate(images=...)` greedy output
(raw HTTP, the `openai` client, streamed), `prompt_tokens` counts the span, prompt caches
reuse a prefix with the same image and never past another image (in memory and after a
restart from --prompt-cache-dir), and bad image parts are 400s naming the part."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
from PIL import Image

import mlx_v41
from conftest import golden_checkpoint, reference_ops
from mlx_v41.chat import format as cf
from server_harness import MODEL_ID, Forcing, LiveServer, forcing_server, post
from vision_fixtures import SMALL_MIN_PIXELS, TWIN_SPAN, twin_images, vision_checkpoint

pytestmark = pytest.mark.usefixtures("cpu")

CHAT_OFF = {"chat_template_kwargs": {"thinking": False}}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    folder = vision_checkpoint(tmp_path_factory.mktemp("vision") / "hf", SMALL_MIN_PIXELS)
    model, tokenizer = mlx_v41.load(folder, dspark=False)
    return reference_ops(model), tokenizer


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    return twin_images(tmp_path_factory.mktemp("images"))


@pytest.fixture(scope="module")
def live(loaded):
    yield from forcing_server(*loaded)


def data_uri(path, media_type="image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(path.read_bytes()).decode()


def image_message(text: str, image, before: str = "") -> dict:
    """A user message: optional text, an OpenAI image_url part, then `text`."""
    parts = [{"type": "text", "text": before}] if before else []
    parts += [{"type": "image_url", "image_url": {"url": data_uri(image)}},
              {"type": "text", "text": text}]
    return {"role": "user", "content": parts}


def as_blocks(messages: list) -> list:
    """The same messages for `mlx_v41`'s chat format: image parts as image blocks (the URI)."""
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = [{"type": "image", "image": p["image_url"]["url"]}
                       if p["type"] == "image_url" else p for p in content]
        out.append(dict(message, content=content))
    return out


def reference(loaded, messages, max_tokens):
    """(text, tokens, prompt tokens) of `stream_generate(images=...)` on the same chat."""
    model, tokenizer = loaded
    blocks = as_blocks(messages)
    ids = tokenizer.apply_chat_template(blocks, enable_thinking=False)
    responses = list(mlx_v41.stream_generate(model, tokenizer, ids, max_tokens=max_tokens,
                                             images=cf.collect_images(blocks)))
    return "".join(r.text for r in responses), [r.token for r in responses], \
        responses[-1].prompt_tokens


def text_tokens(loaded, messages) -> int:
    """Prompt length with each image as its one placeholder token."""
    return len(loaded[1].apply_chat_template(as_blocks(messages), enable_thinking=False))


def chat(server, messages, **fields):
    status, body = post(server.port, "/v1/chat/completions",
                        {"messages": messages, **CHAT_OFF, **fields})
    assert status == 200, body
    return body


# ----------------------------------------------------------------------------- replies

@pytest.mark.slow
def test_image_reply_equals_stream_generate(live, loaded, twins):
    messages = [image_message("What is this?", twins[0])]
    text, tokens, prompt_tokens = reference(loaded, messages, 5)
    assert prompt_tokens == text_tokens(loaded, messages) - 1 + TWIN_SPAN
    raw = chat(live, messages, max_tokens=5)
    assert raw["choices"][0]["message"]["content"] == text
    assert raw["usage"]["prompt_tokens"] == prompt_tokens
    assert raw["usage"]["completion_tokens"] == len(tokens)
    reply = live.client().chat.completions.create(model=MODEL_ID, messages=messages,
                                                  max_tokens=5, extra_body=CHAT_OFF)
    assert reply.choices[0].message.content == text
    assert reply.usage.prompt_tokens == prompt_tokens
    other, _, _ = reference(loaded, [image_message("What is this?", twins[1])], 5)
    assert other != text  # the reply depends on the pixels, not only the token ids


@pytest.mark.slow
def test_image_part_spellings_and_streaming(live, loaded, twins):
    """The string form of `image_url`, the `image` and `input_image` part types, and a
    streamed reply (with usage) all give the same reply."""
    messages = [image_message("Describe it.", twins[1])]
    text, tokens, prompt_tokens = reference(loaded, messages, 4)
    uri = data_uri(twins[1])
    for part in ({"type": "image_url", "image_url": uri}, {"type": "image", "image": uri},
                 {"type": "input_image", "image_url": uri}):
        body = chat(live, [{"role": "user", "content": [part, {"type": "text",
                                                               "text": "Describe it."}]}],
                    max_tokens=4)
        assert body["choices"][0]["message"]["content"] == text, part["type"]
    stream = live.client().chat.completions.create(
        model=MODEL_ID, messages=messages, max_tokens=4, stream=True,
        stream_options={"include_usage": True}, extra_body=CHAT_OFF)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.prompt_tokens == prompt_tokens
    assert chunks[-1].usage.completion_tokens == len(tokens)


@pytest.mark.slow
def test_two_images_fill_their_placeholders_in_order(live, loaded, twins):
    parts = [{"type": "image_url", "image_url": {"url": data_uri(path)}} for path in twins]
    messages = [{"role": "user", "content": [parts[0], {"type": "text", "text": "or"},
                                             parts[1]]}]
    text, _, prompt_tokens = reference(loaded, messages, 4)
    assert prompt_tokens == text_tokens(loaded, messages) + 2 * (TWIN_SPAN - 1)
    body = chat(live, messages, max_tokens=4)
    assert body["choices"][0]["message"]["content"] == text
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    swapped = [{"role": "user", "content": [parts[1], {"type": "text", "text": "or"},
                                            parts[0]]}]
    assert chat(live, swapped, max_tokens=4)["choices"][0]["message"]["content"] == \
        reference(loaded, swapped, 4)[0]


# ----------------------------------------------------------------------------- prompt caches

def before_span(loaded, messages) -> int:
    """Prompt tokens before the first image's span (what a cache of another image may keep)."""
    _, tokenizer = loaded
    text = tokenizer.apply_chat_template(as_blocks(messages), enable_thinking=False,
                                         tokenize=False)
    return len(tokenizer.encode(text.split(cf.IMAGE_PLACEHOLDER)[0], add_special_tokens=False))


def fresh_reply(loaded, messages, max_tokens: int) -> str:
    return reference(loaded, messages, max_tokens)[0]


@pytest.mark.slow
def test_second_turn_with_the_same_image_reuses_it(live, loaded, twins):
    """Turn 2 resumes from turn 1's prompt and reply; with image 1 in image 0's place
    (equal token ids, other pixels) nothing from the span on is reused (here nothing at all:
    no entry can roll back that far) and the reply is the fresh one."""
    reply = "A red box."
    script = live.hook.add("turns", reply)
    first_turn = [image_message("What is it?", twins[0], "Look at this:")]
    second = first_turn + [{"role": "assistant", "content": reply},
                           {"role": "user", "content": "And now?"}]
    swapped = [image_message("What is it?", twins[1], "Look at this:")] + second[1:]
    first = chat(live, first_turn, max_tokens=20, user="turns")
    assert first["choices"][0]["message"]["content"] == reply
    same = chat(live, second, max_tokens=3)
    assert same["usage"]["prompt_tokens_details"]["cached_tokens"] == \
        first["usage"]["prompt_tokens"] + len(script)
    other = chat(live, swapped, max_tokens=3)
    assert other["usage"]["prompt_tokens"] == same["usage"]["prompt_tokens"]
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] <= before_span(loaded,
                                                                                   swapped)
    assert other["choices"][0]["message"]["content"] == fresh_reply(loaded, swapped, 3)


def check_image_keys(ask, loaded, twins, before: str) -> None:
    """One short turn (within two windows, where a cache rolls back every token) with image
    0; the same again reuses all but the last token; image 1 in its place exactly the text
    before the span, and its entry (the same token ids: the reply is forced) does not stand
    in for image 0's. `ask(messages)` sends a request whose one reply token is forced."""
    first = [image_message("?", twins[0], before)]
    other = [image_message("?", twins[1], before)]
    n = ask(first)["usage"]["prompt_tokens"]
    assert n + 1 <= 2 * loaded[0].cfg.sliding_window
    again = ask(first)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1
    swapped = ask(other)
    assert swapped["usage"]["prompt_tokens_details"]["cached_tokens"] == \
        before_span(loaded, other) > 0
    assert ask(first)["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1


def test_another_image_reuses_only_the_text_before_it(live, loaded, twins):
    live.hook.add("one token", "!")
    check_image_keys(lambda messages: chat(live, messages, max_tokens=1, user="one token"),
                     loaded, twins, "L")


@pytest.mark.slow
def test_prompt_cache_dir_keeps_the_image_keys(loaded, twins, tmp_path):
    """Each request on a new server that starts from the folder alone."""
    model, tokenizer = loaded
    folder, hook = tmp_path / "prompts", Forcing(tokenizer)
    hook.add("one token", "!")

    def ask(messages):
        server = LiveServer(model, tokenizer, folder=folder, hook=hook)
        try:
            return chat(server, messages, max_tokens=1, user="one token")
        finally:
            server.close()

    check_image_keys(ask, loaded, twins, "R")


# ----------------------------------------------------------------------------- bad input

def png_bytes(width: int, height: int, noise: bool = False) -> bytes:
    pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8) \
        if noise else np.full((height, width, 3), 90, np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def inline(data: bytes, media_type="image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


BAD_IMAGES = [
    ("https://example.com/cat.png", ".image_url.url", "not fetched by this server"),
    ("http://127.0.0.1:1/x.png", ".image_url.url", "not fetched by this server"),
    ("/etc/hostname", ".image_url.url", "paths and other URLs are refused"),
    ("file:///etc/hostname", ".image_url.url", "paths and other URLs are refused"),
    ("data:image/png;base64,@@@@", "", "invalid base64"),
    ("data:image/png,rawbytes", "", "not base64"),
    (inline(b"plain text, not a picture"), "", "not an image this server reads"),
    (inline(png_bytes(20, 20)[:60]), "", "not a readable image"),
    (inline(png_bytes(20, 20), "text/plain"), "", "media type 'text/plain' is not an image"),
    (inline(png_bytes(4000, 3)), "", "too large (4000 x 3 pixels"),
    (inline(png_bytes(100, 100, noise=True)), "", "too large"),
]


@pytest.mark.parametrize("url, field, words", BAD_IMAGES)
def test_bad_image_parts(live, monkeypatch, url, field, words):
    config = live.app.state.config  # small limits: the noisy PNG has ~30 kB, 10,000 pixels
    monkeypatch.setattr(config, "max_image_bytes", 20_000)
    monkeypatch.setattr(config, "max_image_pixels", 11_000)
    before = [(e.state.tokens, e.nbytes) for e in live.store.entries]
    status, body = post(live.port, "/v1/chat/completions", {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "x"},
                                     {"type": "image_url", "image_url": {"url": url}}]}]})
    error = body["error"]
    assert status == 400 and words in error["message"], error
    assert error["param"] == "messages[0].content[1]" + field
    assert error["message"].startswith(error["param"] + ": ") and "\n" not in error["message"]
    assert [(e.state.tokens, e.nbytes) for e in live.store.entries] == before


def test_images_where_they_cannot_go(live, twins):
    part = {"type": "image_url", "image_url": {"url": data_uri(twins[0])}}
    status, body = post(live.port, "/v1/chat/completions", {"messages": [
        {"role": "system", "content": [part]}, {"role": "user", "content": "hi"}]})
    assert status == 400 and body["error"]["param"] == "messages[0].content[0]"
    assert "user and tool messages" in body["error"]["message"]
    status, body = post(live.port, "/v1/chat/completions", {"messages": [
        {"role": "user", "content": f"a literal {cf.IMAGE_PLACEHOLDER}"}]})
    assert status == 400 and "image placeholder" in body["error"]["message"]
    status, body = post(live.port, "/v1/completions", {"prompt": f"x {cf.IMAGE_PLACEHOLDER}"})
    assert status == 400 and body["error"]["param"] == "prompt"
    assert "1 image placeholder(s)" in body["error"]["message"]


def test_a_model_without_the_tower_refuses_images(twins):
    model, tokenizer = mlx_v41.load(golden_checkpoint("tiny"), dspark=False, vision=False)
    server = LiveServer(model, tokenizer)
    try:
        with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content\[0\]: "
                                                         "image input needs the vision tower"):
            server.client().chat.completions.create(
                model=MODEL_ID, messages=[image_message("What is it?", twins[0])])
        reply = server.client().chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
        assert reply.usage.completion_tokens == 1
    finally:
        server.close()
