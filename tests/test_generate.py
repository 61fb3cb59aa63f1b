"""`mlx_v41.load` / `generate` / `stream_generate`, the tokenizer and the `mlx_v41.generate` CLI,
on the tiny golden checkpoint (a few tokens, greedy or seeded sampling).

Streams are compared with the model called directly, often over other chunkings of the same
tokens (a prompt cache continued, prefill steps of 4), which gives identical logits on MLX's
CPU backend only: the module runs there (the `cpu` fixture), on the reference ops."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import make_sampler

import mlx_v41
from mlx_v41.chat import format as cf
from mlx_v41.cache.layer import CacheError
from mlx_v41.generation.prompt_reuse import PromptCache, reuse_prompt_cache
from mlx_v41.generation.api import PromptTooLongError, stream_generate
from mlx_v41.cli.generate import main, setup_arg_parser
from conftest import golden_checkpoint, reference_ops, with_context, without_plan, writable_copy

pytestmark = pytest.mark.usefixtures("cpu")

REPO = Path(__file__).resolve().parents[1]
GOLDEN = golden_checkpoint("tiny")
RULE = "=" * 10


def load_on_ops(path, **kwargs):
    """`mlx_v41.load` with the model on the reference ops."""
    model, tokenizer = mlx_v41.load(path, **kwargs)
    return reference_ops(model), tokenizer


@pytest.fixture(scope="module")
def loaded():
    return load_on_ops(GOLDEN)


@pytest.fixture(scope="module")
def reference(loaded):
    """The greedy continuation of the default chat prompt, by the model called directly."""
    model, tokenizer = loaded
    return greedy_reference(model, chat_ids(tokenizer), 3)


@pytest.fixture
def cached_load(monkeypatch):
    """The CLI's `load`, memoised (CLI tests load each checkpoint once), on the reference ops."""
    import functools

    module = sys.modules["mlx_v41.cli.generate"]
    monkeypatch.setattr(module, "load", functools.lru_cache(None)(load_on_ops))


@pytest.fixture(scope="module")
def short_context(tmp_path_factory):
    """The tiny golden with a 40-token context."""
    return with_context(writable_copy(GOLDEN, tmp_path_factory.mktemp("short") / "hf"), 40)


def greedy_reference(model, ids, n):
    """The model called directly: prefill, then argmax one token at a time."""
    cache = model.make_cache()
    logits = model.prefill(mx.array([ids]), cache)[:, -1]
    out = []
    for _ in range(n):
        out.append(int(mx.argmax(logits, axis=-1).item()))
        logits = model(mx.array([[out[-1]]]), cache=cache)[:, -1]
    return out


def chat_ids(tokenizer, text="Hello there", thinking=False):
    return tokenizer.encode_chat([{"role": "user", "content": text}], thinking)


def one_line(text: str) -> str:
    lines = without_plan(text).strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


# ---------------------------------------------------------------- API

def test_stream_generate_matches_the_model_greedy(loaded, reference):
    model, tokenizer = loaded
    ids = chat_ids(tokenizer)
    responses = list(stream_generate(model, tokenizer, ids, max_tokens=3))
    tokens = [r.token for r in responses]
    assert tokens == reference
    assert [r.generation_tokens for r in responses] == [1, 2, 3]
    assert [r.finish_reason for r in responses] == [None, None, "length"]
    last = responses[-1]
    assert last.prompt_tokens == len(ids) and last.prompt_tps > 0 and last.generation_tps > 0
    assert last.peak_memory > 0 and last.logprobs.shape == (model.args.text_config.vocab_size,)
    text = "".join(r.text for r in responses)
    assert text == tokenizer.decode(tokens, skip_special_tokens=False)
    first = tokenizer.decode(tokens[:1], skip_special_tokens=False)
    assert mlx_v41.generate(model, tokenizer, ids, max_tokens=1) == first


def test_text_prompt_gets_one_bos(loaded):
    model, tokenizer = loaded
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                             enable_thinking=False)
    assert rendered == "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>"
    assert tokenizer.encode_prompt(rendered) == chat_ids(tokenizer, "Hi")
    assert tokenizer.encode_prompt("Hi")[0] == 0
    first = next(iter(stream_generate(model, tokenizer, "Hi", max_tokens=1)))
    assert first.prompt_tokens == len(tokenizer.encode_prompt("Hi"))


def test_stops_on_eos_and_feeds_it(loaded):
    model, tokenizer = loaded
    eos = tokenizer.convert_tokens_to_ids(cf.EOS)
    assert tokenizer.eos_token_ids == {eos}
    steps = []

    def eos_third(history, logits):  # force EOS at the third generated token
        steps.append(1)
        bonus = (mx.arange(logits.shape[-1]) == eos) * (1e9 if len(steps) == 3 else 0.0)
        return logits + bonus

    ids, cache = chat_ids(tokenizer), model.make_cache()
    responses = list(stream_generate(model, tokenizer, ids, max_tokens=10, prompt_cache=cache,
                                     logits_processors=[eos_third]))
    assert responses[-1].finish_reason == "stop" and responses[-1].token == eos
    assert responses[-1].generation_tokens == 3 and cf.EOS not in "".join(r.text for r in responses)
    assert cache[0].offset == len(ids) + 3  # every yielded token was fed, EOS included


def sampled(model, tokenizer, ids, seed: int, n: int, **kwargs) -> list:
    mx.random.seed(seed)
    return [r.token for r in stream_generate(model, tokenizer, ids, max_tokens=n,
                                             sampler=make_sampler(**kwargs))]


def test_sampling_is_seeded(loaded, reference):
    model, tokenizer = loaded
    ids = chat_ids(tokenizer)
    args = dict(temp=1.5, top_p=0.9, min_p=0.01, top_k=50)
    assert sampled(model, tokenizer, ids, 7, 2, **args) == sampled(model, tokenizer, ids, 7, 2,
                                                                   **args)
    assert sampled(model, tokenizer, ids, 7, 2, temp=1.0, top_k=1) == reference[:2]


def test_stream_samples_the_models_logits(loaded):
    """Temperature 1: the stream's tokens are draws from the model's own distributions, one
    per step with the seeded key sequence (a categorical draw of the prefill's last logits,
    then of each fed token's), and not the greedy ones (measured: 6 of 8 differ)."""
    model, tokenizer = loaded
    ids, n = chat_ids(tokenizer), 8
    streamed = sampled(model, tokenizer, ids, 11, n, temp=1.0)
    mx.random.seed(11)
    cache, direct = model.make_cache(), []
    logits = model.prefill(mx.array([ids]), cache)[:, -1]
    for _ in range(n):
        direct.append(int(mx.random.categorical(logits - mx.logsumexp(logits, axis=-1)).item()))
        logits = model(mx.array([[direct[-1]]]), cache=cache)[:, -1]
    assert streamed == direct
    greedy = greedy_reference(model, ids, n)
    assert sum(a != b for a, b in zip(streamed, greedy)) >= n // 2, (streamed, greedy)


def test_streaming_never_splits_a_character(loaded):
    _, tokenizer = loaded
    text = "héllo wörld 中文 🙂 naïve"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text)  # multi-byte characters span several tokens
    detokenizer, segments = tokenizer.detokenizer, []
    for token in ids:
        detokenizer.add_token(token)
        segments.append(detokenizer.last_segment)
    detokenizer.finalize()
    segments.append(detokenizer.last_segment)
    assert "".join(segments) == text and not any("\ufffd" in s for s in segments)
    assert "" in segments  # held back until the character's last byte
    noise = [int(t) for t in mx.random.randint(0, 512, (300,), key=mx.random.key(3)).tolist()]
    detokenizer.reset()
    for token in noise:
        detokenizer.add_token(token)
    detokenizer.finalize()
    assert detokenizer.text == tokenizer.decode(noise, skip_special_tokens=False)


def test_chat_tokens_are_single_tokens(loaded):
    _, tokenizer = loaded
    assert tokenizer.missing_chat_tokens == []
    for token in (cf.SYSTEM, cf.USER, cf.ASSISTANT, cf.THINK_START, cf.THINK_END):
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1


def test_continuing_a_prompt_cache_equals_one_shot(loaded, reference):
    model, tokenizer = loaded
    ids = chat_ids(tokenizer)
    cache = model.make_cache()
    mx.eval(model.prefill(mx.array([ids[:-5]]), cache))
    split = [r.token for r in stream_generate(model, tokenizer, ids[-5:], max_tokens=2,
                                              prompt_cache=cache)]
    assert split == reference[:2]


def test_prompt_cache_rewind(loaded):
    model, _ = loaded
    # A cache can be rolled back by up to window + 1 = 17 tokens, also right after a CED
    # prefill (its decoder halo keeps that much); further back it is refused, untouched.
    prompt = list(range(3, 63))
    near, far = prompt[:50] + [7, 8], prompt[:30] + [7]
    cache = model.make_cache()
    mx.eval(model.prefill(mx.array([prompt]), cache))
    state = PromptCache(cache, list(prompt))
    assert state.copy().rewind_for(prompt) == len(prompt) - 1  # one token left to run
    assert state.copy().rewind_for(near) == 50
    assert state.copy().rewind_for(far) is None  # 30 tokens back: beyond what the rings hold
    assert cache[0].offset == len(prompt) and state.tokens == prompt  # candidates untouched
    best, index = reuse_prompt_cache(model, near, [None, state])
    assert index == 1 and best.tokens == near[:50] and best.cache[0].offset == 50
    fresh, index = reuse_prompt_cache(model, far, [state])
    assert index is None and fresh.tokens == [] and fresh.cache[0].offset == 0
    with pytest.raises(CacheError):
        mlx_v41.trim_cache(cache, 18)


def test_context_limit(short_context):
    model, tokenizer = load_on_ops(short_context)
    with pytest.raises(PromptTooLongError, match="max_position_embeddings"):
        next(stream_generate(model, tokenizer, list(range(3, 43))))
    responses = list(stream_generate(model, tokenizer, list(range(3, 38)), max_tokens=10))
    assert responses[-1].generation_tokens == 5 and responses[-1].finish_reason == "length"
    # Drafting stops at the context too: a verify past it would raise in the forward.
    drafted = list(stream_generate(model, tokenizer, list(range(3, 38)), max_tokens=10,
                                   draft="dspark"))
    assert [r.token for r in drafted] == [r.token for r in responses]
    assert drafted[-1].finish_reason == "length" and drafted[-1].draft_stats.proposed > 0


def test_load_from_the_hub(monkeypatch):
    import huggingface_hub

    calls = []

    def fake_download(repo, allow_patterns):
        calls.append((repo, allow_patterns))
        if repo == "someone/missing":
            raise huggingface_hub.errors.RepositoryNotFoundError("404 Client Error")
        return str(GOLDEN)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    model, tokenizer = mlx_v41.load("deepseek-ai/tiny")
    assert calls[0] == ("deepseek-ai/tiny", ["*.json", "*.safetensors"])
    assert model.args.text_config.vocab_size == 512 and len(tokenizer) == 512
    with pytest.raises(mlx_v41.CheckpointError, match="someone/missing.*Hugging Face"):
        mlx_v41.load("someone/missing")


# ---------------------------------------------------------------- CLI

def run_cli(capsys, *argv, stdin=None, monkeypatch=None):
    if stdin is not None:
        import io
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main(["--model", str(GOLDEN), *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_prints_the_stream_stats_and_progress(capsys, loaded, reference, cached_load):
    _, tokenizer = loaded
    code, out, err = run_cli(capsys, "-p", "Hello there", "-m", "3", "--no-thinking",
                             "--prefill-step-size", "4")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == RULE and lines[-4] == RULE
    assert "\n".join(lines[1:-4]) == tokenizer.decode(reference, skip_special_tokens=False)
    n = len(chat_ids(tokenizer))
    assert lines[-3].startswith(f"Prompt: {n} tokens, ") and lines[-3].endswith("tokens-per-sec")
    assert lines[-2].startswith("Generation: 3 tokens, ")
    assert lines[-1].startswith("Peak memory: ") and lines[-1].endswith(" GB")
    assert f"\rprefill 4/{n} tokens, " in err and f"\rprefill {n}/{n} tokens, " in err


def test_cli_prompt_options(capsys, monkeypatch, loaded, cached_load):
    _, tokenizer = loaded
    code, out, _ = run_cli(capsys, "-p", "-", "--system-prompt", "Be brief.",
                           "--reasoning-effort", "max", "-m", "1", stdin="Hi",
                           monkeypatch=monkeypatch)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    n = len(tokenizer.encode_chat(messages, thinking=True, reasoning_effort="max"))
    assert code == 0 and f"Prompt: {n} tokens" in out
    code, out, _ = run_cli(capsys, "-p", "raw text", "--ignore-chat-template", "-m", "1",
                           "--temp", "0.8", "--top-p", "0.9", "--min-p", "0.1", "--top-k", "5",
                           "--seed", "3", "--prefill-mode", "full")
    assert code == 0 and f"Prompt: {len(tokenizer.encode_prompt('raw text'))} tokens" in out


# With a confidence threshold the drafts proposed per cycle follow the drafter's confidence,
# which reads the draft rings: equal Drafts lines mean the reused file restored them.
@pytest.mark.parametrize("name, flags", [
    ("prompt.safetensors", ()), ("p.cache", ()),
    ("dspark.cache", ("--dspark", "-m", "8", "--draft-confidence", "0.3"))])
@pytest.mark.slow
def test_cli_prompt_cache_file(capsys, tmp_path, cached_load, name, flags):
    path = tmp_path / name
    argv = ("-p", "Hello there", "-m", "2", *flags, "--prompt-cache-file", str(path))
    first = run_cli(capsys, *argv)
    assert first[0] == 0 and path.is_file() and "prompt cache" not in first[2]
    second = run_cli(capsys, *argv)
    n = int(first[1].split("Prompt: ")[1].split()[0])
    assert f"prompt cache: reusing {n - 1} of {n} prompt tokens" in second[2]
    assert "Prompt: 1 tokens" in second[1]
    text = lambda out: out.split(RULE)[1]  # noqa: E731
    assert text(second[1]) == text(first[1])
    assert drafts_lines(second[1]) == drafts_lines(first[1])
    assert len(drafts_lines(first[1])) == bool(flags)


def drafts_lines(out: str) -> list:
    return [line for line in out.splitlines() if line.startswith("Drafts: ")]


@pytest.mark.slow
def test_cli_dspark_equals_plain_greedy(capsys, cached_load):
    """Speculative decoding at temp 0 prints plain greedy decoding's text, for every draft
    length and with a confidence threshold, and adds the Drafts line to the stats."""
    argv = ("-p", "Hello there", "-m", "24", "--no-thinking")
    code, plain, _ = run_cli(capsys, *argv)
    assert code == 0 and "Drafts: " not in plain
    for flags in ((), ("--num-draft-tokens", "2", "--draft-confidence", "0.5")):
        code, drafted, _ = run_cli(capsys, *argv, "--dspark", *flags)
        assert code == 0 and drafted.split(RULE)[1] == plain.split(RULE)[1]
        line = drafted.splitlines()[-2]
        assert re.fullmatch(r"Drafts: \d+ accepted of \d+ proposed, [\d.]+ tokens per verify "
                            r"cycle", line), line


def test_cli_dspark_needs_the_drafters_tensors(capsys, tmp_path):
    import json

    folder = writable_copy(GOLDEN, tmp_path / "hf")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items()
                           if not k.startswith("mtp.")}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert main(["--model", str(folder), "-m", "1"]) == 0
    capsys.readouterr()
    assert main(["--model", str(folder), "-m", "1", "--dspark"]) == 1
    line = one_line(capsys.readouterr().err)
    assert line.startswith("error: ") and str(folder) in line
    assert "mtp." in line or "dspark." in line  # the drafter's tensors or parameters


def test_cli_bad_input(capsys, tmp_path, short_context):
    assert main(["--model", str(tmp_path / "nope")]) == 1
    assert "model folder not found" in one_line(capsys.readouterr().err)
    (tmp_path / "config.json").write_text((GOLDEN / "config.json").read_text())
    assert main(["--model", str(tmp_path)]) == 1
    assert "tokenizer.json not found" in one_line(capsys.readouterr().err)
    shutil.copy(GOLDEN / "tokenizer.json", tmp_path)
    assert main(["--model", str(tmp_path)]) == 1
    assert "model.safetensors.index.json" in one_line(capsys.readouterr().err)
    for flags in (["--prefill-mode", "fast"], ["--reasoning-effort", "medium"], ["-m", "0"],
                  ["--temp", "hot"], ["--top-p", "2"], ["--num-draft-tokens", "0"],
                  ["--num-draft-tokens", "6"], ["--num-draft-tokens", "2.5"],
                  ["--draft-confidence", "0"], ["--draft-confidence", "1.5"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["--model", str(GOLDEN), *flags])
        assert exit_info.value.code == 2 and "error: argument" in one_line(capsys.readouterr().err)
    assert main(["--model", str(short_context), "-p", "word " * 50]) == 1
    assert "context is 40 tokens" in one_line(capsys.readouterr().err)


# argv bytes that are not UTF-8 reach Python as lone surrogates ("\xff" -> "\udcff")
@pytest.mark.parametrize("flag, value, words", [
    ("--seed", "-1", "is not a seed in 0..18446744073709551615"),
    ("--seed", str(2**64), "is not a seed"),
    ("--temp", "nan", "'nan' is not a temperature"), ("--temp", "inf", "'inf' is not"),
    ("--top-p", "nan", "'nan' is not a probability"),
    ("--min-p", "nan", "'nan' is not a probability"),
    ("-p", "a\udcffb", "not valid UTF-8 (byte 0xff at character 1)"),
    ("--system-prompt", "\ud800", "not valid UTF-8 (lone surrogate U+D800 at character 0)")])
def test_cli_refuses_bad_values_naming_the_flag(capsys, flag, value, words):
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(GOLDEN), flag, value])
    line = one_line(capsys.readouterr().err)
    assert exit_info.value.code == 2 and f"error: argument {flag}" in line and words in line, line


def test_cli_refuses_stdin_that_is_not_utf8(capsys, monkeypatch, cached_load):
    import io

    # stdin decoding with surrogateescape (Python's default in the C and POSIX locales)
    code, _, err = run_cli(capsys, "-p", "-", stdin="a\udcffb", monkeypatch=monkeypatch)
    assert code == 1 and one_line(err) == \
        "error: stdin (-p -): not valid UTF-8 (byte 0xff at character 1)"
    strict = io.TextIOWrapper(io.BytesIO(b"ab\xfe"), encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", strict)
    assert main(["--model", str(GOLDEN), "-p", "-"]) == 1
    assert one_line(capsys.readouterr().err) == "error: stdin (-p -): not valid utf-8 (byte 0xfe)"


def test_help_marks_ced_replay_approximate():
    text = " ".join(setup_arg_parser().format_help().split())
    assert "ced_replay" in text and "APPROXIMATE" in text


def test_console_scripts_and_dispatch(capsys, cached_load):
    text = (REPO / "pyproject.toml").read_text().split("[project.scripts]")[1].split("\n[")[0]
    scripts = dict(re.findall(r'"([^"]+)"\s*=\s*"([^"]+)"', text))
    for name in ("mlx_v41.generate", "mlx_v41.chat", "mlx_v41.demo"):
        module, function = scripts[name].split(":")
        assert callable(getattr(__import__(module, fromlist=[function]), function))
    from mlx_v41.__main__ import main as dispatch

    assert dispatch(["generate", "--model", str(GOLDEN), "-p", "Hi", "-m", "1"]) == 0
    assert "Generation: 1 tokens" in capsys.readouterr().out
    assert dispatch(["bogus"]) == 2 and "unknown command" in capsys.readouterr().err


# ---------------------------------------------------------------- reasoning shown apart

PIECES = ["Let me", " think.</", "think>", "Yes."]  # `</think>` split across two pieces


@pytest.fixture
def scripted_text(monkeypatch, cached_load):
    """The CLI's stream with PIECES as its texts (the tokens are the model's)."""
    import dataclasses

    module = sys.modules["mlx_v41.cli.generate"]
    decode = module.stream_decode

    def scripted(*args, **kwargs):
        for piece, response in zip(PIECES, decode(*args, **kwargs)):
            yield dataclasses.replace(response, text=piece)

    monkeypatch.setattr(module, "stream_decode", scripted)


@pytest.mark.parametrize("flags, printed", [
    ((), "[thinking]\nLet me think.\n[answer]\nYes."),
    (("--hide-thinking",), "Yes."),
    (("--no-thinking",), "".join(PIECES)),  # chat mode: no reasoning to set apart
    (("--ignore-chat-template",), "".join(PIECES)),
])
def test_cli_prints_the_reasoning_apart(capsys, scripted_text, flags, printed):
    code, out, _ = run_cli(capsys, "-p", "Hi", "-m", "4", *flags)
    assert code == 0 and out.split(RULE)[1] == f"\n{printed}\n"


def printed(pieces, thinking=True, **options) -> str:
    import io

    from mlx_v41.cli.reasoning import ReplyPrinter

    out = io.StringIO()
    printer = ReplyPrinter(out, thinking, **options)
    for piece in pieces:
        printer.write(piece)
    printer.finish()
    return out.getvalue()


def test_reasoning_on_a_terminal_is_dimmed_or_noted():
    dim, reset = "\x1b[2m", "\x1b[0m"
    assert printed(PIECES, styled=True) == \
        f"{dim}Let me{reset}{dim} think.{reset}\n\nYes."
    assert printed(PIECES, styled=True, show=False) == \
        f"{dim}thinking...{reset}\r\x1b[2KYes."
    assert printed(["a</b", "</thi", "nk"], styled=False) == "[thinking]\na</b</think"
    assert printed(["Why\n</think>", "So."], styled=False) == "[thinking]\nWhy\n[answer]\nSo."
    assert printed(["</think>So."], styled=False) == "[answer]\nSo."  # no reasoning


def test_styles_only_on_a_terminal_without_no_color(monkeypatch):
    import io

    from mlx_v41.cli.reasoning import is_styled

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.delenv("NO_COLOR", raising=False)
    assert is_styled(Terminal()) and not is_styled(io.StringIO())
    monkeypatch.setenv("NO_COLOR", "1")
    assert not is_styled(Terminal())


# ---------------------------------------------------------------- subprocesses

def cli(*args):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return [sys.executable, *args], env


@pytest.mark.slow
def test_python_m_generate_and_ctrl_c():
    """`python -m mlx_v41.generate` starts without warnings; Ctrl-C ends it with one line."""
    argv, env = cli("-m", "mlx_v41.generate", "--model", str(GOLDEN), "-p", "Hi", "-m", "400")
    # SIGINT as a user's shell leaves it, whatever the test runner inherited (an ignored
    # SIGINT would stay ignored in the child).
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, preexec_fn=lambda: signal.signal(signal.SIGINT,
                                                                           signal.SIG_DFL))
    try:
        assert process.stdout.readline() == RULE + "\n"  # generation has started
        time.sleep(0.5)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        process.kill()
    # what came out if not (a reply that ended by itself, a swallowed KeyboardInterrupt)
    assert (process.returncode, without_plan(err)) == (130, "\n[interrupted]\n"), \
        (process.returncode, out[-400:], err[-2000:])


@pytest.mark.slow
def test_every_command_runs_as_a_module(tmp_path):
    """`python -m mlx_v41.X` for the commands that have no package of their own (run at once:
    a Python start costs seconds here)."""
    runs = {name: subprocess.Popen(cli("-m", f"mlx_v41.{name}", *argv)[0],
                                   env=cli()[1], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
            for name, argv in (("inspect", ["--context", "4K"]), ("demo", ["--help"]),
                               ("perplexity", ["--help"]), ("compare", ["--help"]))}
    done = {name: (run.communicate(timeout=120), run.returncode) for name, run in runs.items()}
    for name, ((out, err), code) in done.items():
        assert code == 0 and "Traceback" not in err, (name, err)
    assert "one session at 4,096 tokens" in done["inspect"][0][0]
    for name in ("demo", "perplexity", "compare"):
        assert done[name][0][0].startswith(f"usage: mlx_v41.{name} "), done[name][0][0]
