"""Image prompts through the cache, the API, the CLIs and the chat session, on the vision
golden's checkpoint: chunked == one shot with a chunk boundary at every offset inside a span,
trims into a span, prompt-cache reuse keyed by image content, `images=` in `stream_generate`,
`--image` and `/image`, the converted folder, and one-line errors for bad input.

The checkpoint's `min_pixels` is lowered so that small images keep small spans (17 positions
for the 168 x 126 twins instead of at least 184): prompts stay within two windows, where a
cache can roll back every token, and the ViT runs on a hundred patches. Equalities between
chunkings hold bit for bit on MLX's CPU backend (the `cpu` fixture)."""

from __future__ import annotations

import io
import sys

import mlx.core as mx
import pytest

import mlx_v41
from conftest import packed_state, reference_ops, without_plan
from mlx_v41.chat import format as cf
from mlx_v41.chat.session import ChatSession
from mlx_v41.checkpoint.loader import plan, read_index
from mlx_v41.cli import chat as chat_cli
from mlx_v41.cli import generate as generate_cli
from mlx_v41.generation.prompt_reuse import PromptCache, shared_spans, reuse_prompt_cache
from mlx_v41.model.vision import prepare_prompt
from vision_fixtures import IMAGES, SMALL_MIN_PIXELS, TWIN_SPAN, twin_images, \
    vision_checkpoint

pytestmark = pytest.mark.usefixtures("cpu")

RULE = "=" * 10


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return vision_checkpoint(tmp_path_factory.mktemp("vision") / "hf", SMALL_MIN_PIXELS)


@pytest.fixture(scope="module")
def loaded(folder):
    model, tokenizer = mlx_v41.load(folder)
    return reference_ops(model), tokenizer


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    return twin_images(tmp_path_factory.mktemp("images"))


def raw_ids(tokenizer, text: str) -> list:
    return tokenizer.encode_prompt(text)


def image_prompt(model, tokenizer, images, text="Look: <｜deepseek_image｜> - what?"):
    return prepare_prompt(model, raw_ids(tokenizer, text), images)


def greedy(model, prompt, n: int, cache=None) -> list:
    cache = model.make_cache() if cache is None else cache
    logits = model.prefill(mx.array([prompt.ids]), cache, images=prompt.inputs(model))
    out = []
    for _ in range(n):
        out.append(int(logits[0, -1].argmax().item()))
        logits = model(mx.array([[out[-1]]]), cache=cache)
    return out


# ---------------------------------------------------------------- the cache


def same_state(a: list, b: list) -> bool:
    return all(mx.array_equal(x, y).item() for x, y in zip(packed_state(a), packed_state(b)))


@pytest.mark.slow
def test_chunked_at_every_offset_inside_the_span(loaded, twins):
    """Chunks of one row put a boundary at every offset of the span: every position's logits
    (full prefill) and the last ones (exact CED prefill) and the caches equal one call's."""
    model, tokenizer = loaded
    prompt = image_prompt(model, tokenizer, twins[:1])
    assert prompt.images[0].grid.span_tokens == TWIN_SPAN
    ids = mx.array([prompt.ids])
    for last_only in (False, True):
        one_cache, cache = model.make_cache(), model.make_cache()
        one = model.forward(ids, one_cache, last_only=last_only, images=prompt.inputs(model))
        stepped = model.forward(ids, cache, last_only=last_only, step_size=1,
                                images=prompt.inputs(model))
        assert mx.array_equal(stepped.logits, one.logits).item(), last_only
        assert same_state(cache, one_cache), last_only


def test_calls_that_begin_mid_span(loaded, twins):
    """Ragged calls, each starting inside the span, continue the cache: every position's
    logits and the cache equal one call's."""
    model, tokenizer = loaded
    prompt = image_prompt(model, tokenizer, twins[:1])
    ids, start = mx.array([prompt.ids]), prompt.starts[0]
    one_cache = model.make_cache()
    one = model(ids, cache=one_cache, images=prompt.inputs(model))
    end = start + prompt.images[0].grid.span_tokens
    cuts = [0, start + 1, start + 7, end - 1, ids.shape[1]]
    ragged = model.make_cache()
    for a, b in zip(cuts[:-1], cuts[1:]):
        part = prompt.inputs(model, a)
        logits = model(ids[:, a:b], cache=ragged, images=part.chunk(0, b - a))
        assert mx.array_equal(logits[0], one[0, a:b]).item(), (a, b)
    assert same_state(ragged, one_cache)
    ced = model.prefill(ids, model.make_cache(), images=prompt.inputs(model))
    assert mx.array_equal(ced, one[:, -1:]).item()  # the exact CED prefill


def test_trim_into_the_span_and_continue(loaded, twins):
    """Decoded tokens trimmed off leave the prompt's cache; a trim back into the span and
    the span's tail run again give the one-shot cache."""
    model, tokenizer = loaded
    prompt = image_prompt(model, tokenizer, twins[:1], "Look: <｜deepseek_image｜> ok")
    end = prompt.starts[0] + prompt.images[0].grid.span_tokens
    n = len(prompt.ids)
    cache = model.make_cache()
    logits = model.prefill(mx.array([prompt.ids]), cache, images=prompt.inputs(model))
    expected = packed_state(cache)
    for token in (5, 6, 7):
        model(mx.array([[token]]), cache=cache)
    mlx_v41.trim_cache(cache, 3)
    assert all(mx.array_equal(a, b).item() for a, b in zip(packed_state(cache), expected))
    back = n - (end - 5)  # five span positions and the text after the span
    mlx_v41.trim_cache(cache, back)
    again = model.prefill(mx.array([prompt.ids[-back:]]), cache,
                          images=prompt.inputs(model, n - back))
    assert mx.array_equal(again, logits).item()
    assert all(mx.array_equal(a, b).item() for a, b in zip(packed_state(cache), expected))


def test_prompt_cache_never_pairs_a_prefix_with_another_image(loaded, twins):
    """Equal ids, other pixels: the cache is rolled back to the text before the span (also a
    cache that has no image records), and the rest run then equals a fresh prefill."""
    model, tokenizer = loaded
    first, second = (image_prompt(model, tokenizer, [path]) for path in twins)
    assert first.ids == second.ids and first.records() != second.records()
    assert len(first.ids) < 2 * model.cfg.sliding_window  # a trim can undo every token
    cache = model.make_cache()
    model.prefill(mx.array([first.ids]), cache, images=first.inputs(model))
    held = PromptCache(cache, list(first.ids), first.records())
    same, index = reuse_prompt_cache(model, first.ids, [held], first.records())
    assert index == 0 and len(same.tokens) == len(first.ids) - 1
    start = second.starts[0]
    for candidate in (held, PromptCache(cache, list(first.ids))):
        other, index = reuse_prompt_cache(model, second.ids, [candidate], second.records())
        assert index == 0 and len(other.tokens) == start and other.cache[0].offset == start
    assert len(held.tokens) == len(first.ids) and held.cache[0].offset == len(first.ids)
    model.prefill(mx.array([second.ids[start:]]), other.cache, images=second.inputs(model, start))
    fresh = model.make_cache()
    model.prefill(mx.array([second.ids]), fresh, images=second.inputs(model))
    assert same_state(other.cache, fresh)
    n = len(first.ids)
    later = [dict(r, start=n + 3) for r in second.records()]  # a new image past the cache
    assert shared_spans(n, first.records(), first.records() + later) == n


# ---------------------------------------------------------------- API


@pytest.mark.slow
def test_stream_generate_with_images(loaded):
    """`images=` fills the placeholders in order; text and token-id prompts, and chat image
    blocks through apply_chat_template, give the model's own greedy tokens."""
    model, tokenizer = loaded
    text = "Compare <｜deepseek_image｜> with <｜deepseek_image｜>."
    expected = greedy(model, image_prompt(model, tokenizer, IMAGES, text), 3)
    for prompt in (text, raw_ids(tokenizer, text)):
        tokens = [r.token for r in mlx_v41.stream_generate(model, tokenizer, prompt,
                                                           max_tokens=3, images=IMAGES)]
        assert tokens == expected
    reversed_order = [r.token for r in mlx_v41.stream_generate(
        model, tokenizer, text, max_tokens=3, images=IMAGES[::-1])]
    assert reversed_order != expected
    messages = [{"role": "user", "content": [{"type": "image", "image": str(IMAGES[0])},
                                             {"type": "text", "text": "What is this?"}]}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, enable_thinking=False)
    assert rendered.count(cf.IMAGE_PLACEHOLDER) == 1
    via_blocks = mlx_v41.generate(model, tokenizer, rendered, max_tokens=3,
                                  images=cf.collect_images(messages))
    direct = greedy(model, prepare_prompt(model, tokenizer.encode_prompt(rendered),
                                          [IMAGES[0]]), 3)
    assert via_blocks == tokenizer.decode(direct, skip_special_tokens=False)


def test_bad_image_input(loaded, folder, tmp_path):
    model, tokenizer = loaded
    text = "A <｜deepseek_image｜> B"
    for images in ([], IMAGES):
        with pytest.raises(ValueError, match=rf"1 image placeholder\(s\).*{len(images)} image"):
            next(mlx_v41.stream_generate(model, tokenizer, text, images=images))
    with pytest.raises(ValueError, match="batch 1"):
        prompt = image_prompt(model, tokenizer, IMAGES[:1], text)
        model(mx.array([prompt.ids] * 2), images=prompt.inputs(model))
    blind = mlx_v41.load_model(folder, vision=False)
    assert "vision" not in blind
    dropped = plan(read_index(folder))[1]
    assert dropped["vision.norm.weight"].startswith("vision tower (0.49 B parameters)")
    assert "not loaded (vision=False)" in dropped["image_start"]
    for call in (lambda: next(mlx_v41.stream_generate(blind, tokenizer, text, images=IMAGES[:1])),
                 lambda: next(ChatSession(blind, tokenizer).reply("hi", images=IMAGES[:1])),
                 lambda: ChatSession(blind, tokenizer).attach(IMAGES[0])):
        with pytest.raises(ValueError, match="no vision tower") as error:
            call()
        assert "\n" not in str(error.value)


def test_vision_true_needs_the_tensors(tmp_path):
    from checkpoint_factory import write_checkpoint

    bare = write_checkpoint(tmp_path / "bare", edit=lambda name, t: None if name.startswith(
        ("vision.", "aligner.", "image_")) else t)
    assert "vision" not in mlx_v41.load_model(bare)  # None: only when the checkpoint has it
    with pytest.raises(mlx_v41.CheckpointError, match="no vision tower .* load with vision=False"):
        mlx_v41.load_model(bare, vision=True)


@pytest.mark.slow
def test_converted_folder_keeps_the_tower_bf16(loaded, folder, tmp_path, twins):
    """A requantized conversion keeps every tower tensor verbatim (BF16), so image logits
    equal the published folder's when the text weights are kept exact too."""
    from mlx.utils import tree_flatten

    from mlx_v41.convert import convert

    model, tokenizer = loaded
    out = convert(folder, tmp_path / "mlx", progress=False, log=lambda line: None)
    converted = reference_ops(mlx_v41.load_model(out))
    tower = ("vision.", "aligner.", "image_")
    mine = {k: v for k, v in tree_flatten(converted.parameters()) if k.startswith(tower)}
    theirs = {k: v for k, v in tree_flatten(model.parameters()) if k.startswith(tower)}
    assert mine.keys() == theirs.keys() and len(mine) > 20
    assert all(mx.array_equal(mine[k], theirs[k]).item() for k in mine)
    prompt = image_prompt(model, tokenizer, twins[:1])
    assert greedy(converted, prompt, 2) == greedy(model, prompt, 2)
    q4 = convert(folder, tmp_path / "q4", quantize=True, q_bits=4, progress=False,
                 log=lambda line: None)
    stored = {}
    for path in (q4 / "extras").iterdir():
        stored.update(mx.load(str(path)))
    assert {k for k in stored} == set(theirs) and all(v.dtype == mx.bfloat16
                                                       for v in stored.values())
    assert "vision" in mlx_v41.load_model(q4)


# ---------------------------------------------------------------- CLIs and chat


@pytest.fixture
def cached_load(monkeypatch, loaded):
    for module in (generate_cli, chat_cli):
        monkeypatch.setattr(module, "load", lambda *args, **kwargs: loaded)


def run_generate(capsys, folder, *argv):
    code = generate_cli.main(["--model", str(folder), "-m", "2", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.slow
def test_cli_image_flags(capsys, folder, loaded, cached_load, twins):
    model, tokenizer = loaded
    code, out, _ = run_generate(capsys, folder, "--image", str(twins[0]), "--image",
                                str(twins[1]), "-p", "Which is red?", "--no-thinking")
    content = [{"type": "image", "image": str(twins[0])},  # before the text (mlx-vlm)
               {"type": "image", "image": str(twins[1])}, {"type": "text", "text": "Which is red?"}]
    ids = tokenizer.encode_chat([{"role": "user", "content": content}], False)
    expected = greedy(model, prepare_prompt(model, ids, twins), 2)
    assert code == 0 and out.split(RULE)[1].strip("\n") == tokenizer.decode(
        expected, skip_special_tokens=False)
    n = len(prepare_prompt(model, ids, twins).ids)
    assert f"Prompt: {n} tokens" in out
    code, out, _ = run_generate(capsys, folder, "--ignore-chat-template", "-p",
                                "X <｜deepseek_image｜> Y", "--image", str(twins[1]))
    prompt = image_prompt(model, tokenizer, twins[1:], "X <｜deepseek_image｜> Y")
    expected = greedy(model, prompt, 2)
    assert code == 0 and out.split(RULE)[1].strip("\n") == tokenizer.decode(
        expected, skip_special_tokens=False)


def test_cli_prompt_cache_file_with_images(capsys, folder, tmp_path, cached_load, twins):
    """The file records the image's hash: the same image reuses the whole prompt, another one
    of the same size only what precedes its span (BOS and the user header)."""
    path = tmp_path / "prompt.cache"
    argv = ("-p", "Hi", "--prompt-cache-file", str(path), "--no-thinking", "--image")
    first = run_generate(capsys, folder, *argv, str(twins[0]))
    n = int(first[1].split("Prompt: ")[1].split()[0])
    again = run_generate(capsys, folder, *argv, str(twins[0]))
    assert f"prompt cache: reusing {n - 1} of {n} prompt tokens" in again[2]
    other = run_generate(capsys, folder, *argv, str(twins[1]))
    fresh = run_generate(capsys, folder, "-p", "Hi", "--no-thinking", "--image", str(twins[1]))
    assert f"prompt cache: reusing 2 of {n} prompt tokens" in other[2]
    assert other[1].split(RULE)[1] == fresh[1].split(RULE)[1]


def test_cli_bad_image(capsys, folder, tmp_path, cached_load):
    junk = tmp_path / "junk.png"
    junk.write_text("not a picture")
    code, _, err = run_generate(capsys, folder, "--image", str(junk))
    err = without_plan(err)
    assert code == 1 and err.strip() == f"error: {junk}: not a readable image (unknown format)"
    code, _, err = run_generate(capsys, folder, "--ignore-chat-template", "-p", "no image",
                                "--image", str(IMAGES[0]))
    err = without_plan(err)
    assert code == 1 and "0 image placeholder(s)" in err and err.count("\n") == 1


def test_chat_session_with_images(loaded, tmp_path, twins):
    model, tokenizer = loaded
    session = ChatSession(model, tokenizer, thinking=False, max_tokens=2)
    session.attach(twins[0])
    list(session.reply("What is this?"))
    assert session.messages[0]["content"][0] == {"type": "image", "image": str(twins[0])}
    first = session.stats
    span = session.prompt().images[0].grid.span_tokens
    assert first.prefilled_tokens == first.prompt_tokens > span and session.attached == []
    list(session.reply("And this one?", images=[twins[1]]))
    assert session.stats.reused_tokens > span  # the first image's positions are kept
    path = tmp_path / "session.cache"
    session.save(path)
    restored = ChatSession(model, tokenizer, max_tokens=2)
    restored.load(path)
    assert restored.prompt().ids == session.prompt().ids
    list(restored.reply("Thanks."))
    assert restored.stats.source == "reply" and restored.stats.reused_tokens > 2 * span


def test_chat_image_command(loaded, monkeypatch, capsys, cached_load, twins, tmp_path):
    model, tokenizer = loaded
    session = ChatSession(model, tokenizer, thinking=False, max_tokens=2)
    script = f"/image {twins[0]}\n/image {tmp_path / 'missing.png'}\nWhat is it?\n/image\n"
    assert chat_cli.repl(session, interactive=False, stream=io.StringIO(script)) == 0
    out, err = capsys.readouterr()
    assert f"[image {twins[0]} attached to the next message]" in out
    errors = err.strip().splitlines()
    assert len(errors) == 2 and "missing.png: cannot read the image file" in errors[0]
    assert errors[1] == "error: /image needs a path or URL"
    blocks = session.messages[0]["content"]
    assert [b["type"] for b in blocks] == ["image", "text"] and len(session.messages) == 2
    assert "/image PATH" in chat_cli.HELP
    assert sys.stdin is not None


def test_dspark_after_an_image_prompt(folder, twins):
    """Speculative decoding continues an image prompt exactly as plain greedy decoding."""
    model, tokenizer = mlx_v41.load(folder, dspark=True)
    reference_ops(model)
    kwargs = dict(images=twins[:1], max_tokens=8)
    plain = [r.token for r in mlx_v41.stream_generate(model, tokenizer, "<｜deepseek_image｜>?",
                                                      **kwargs)]
    drafted = [r.token for r in mlx_v41.stream_generate(model, tokenizer, "<｜deepseek_image｜>?",
                                                        draft="dspark", **kwargs)]
    assert drafted == plain and len(plain) == 8


@pytest.mark.slow
def test_image_prompts_in_a_batch(loaded):
    """Image prompts are prefilled alone, then decode in a batch with text prompts: every
    sequence gets its batch-1 tokens."""
    model, tokenizer = loaded
    texts = ["Look: <｜deepseek_image｜> - what?", "No image here, just words.",
             "Compare <｜deepseek_image｜> with <｜deepseek_image｜>."]
    images = [IMAGES[:1], None, IMAGES]
    out = mlx_v41.batch_generate(model, tokenizer, texts, max_tokens=4, images=images,
                                 return_token_ids=True)
    stops = set(tokenizer.eos_token_ids)
    for text, pictures, ids in zip(texts, images, out.token_ids):
        alone = [r.token for r in mlx_v41.stream_generate(model, tokenizer, text, max_tokens=4,
                                                          images=pictures)]
        assert ids == [t for t in alone if t not in stops]
