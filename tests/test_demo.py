"""The demo checkpoint and its tokenizer, `mlx_v41.demo`, `--model demo`, the random-checkpoint
generator the demo installs with the package (and the tests' factory around it), the examples."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

import mlx_v41
from mlx_v41.chat import format as cf
import checkpoint_factory as factory
from mlx_v41.checkpoint import random_checkpoint
from mlx_v41.checkpoint.demo import (CHAT_SPECIALS, MARKER, ensure_demo_checkpoint,
                                     write_demo_tokenizer)
from mlx_v41.chat.tokenizer import load_tokenizer
from mlx_v41.generation.api import generate_step, prefill
from mlx_v41.generation.speculative import DraftStats, Sampling, speculative_steps

REPO = Path(__file__).resolve().parents[1]
GOLDENS = REPO / "tests" / "data" / "goldens"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo checkpoint as `--model demo` finds it, under a private cache root."""
    root, before = tmp_path_factory.mktemp("xdg"), os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(root)  # restored below; `load("demo")` reads it
    try:
        yield ensure_demo_checkpoint(), root
    finally:
        if before is None:
            del os.environ["XDG_CACHE_HOME"]
        else:
            os.environ["XDG_CACHE_HOME"] = before


def test_package_configs_are_the_goldens():
    for name, make in (("tiny", random_checkpoint.tiny_text_config),
                       ("schedule", factory.schedule_text_config)):
        text = (GOLDENS / name / "hf" / "config.json").read_text()
        assert json.dumps(random_checkpoint.root_config(make()), indent=2) == text.strip()


def test_factory_gives_512_token_checkpoints_the_golden_tokenizer(tmp_path):
    folder = factory.write_checkpoint(tmp_path / "a", engram=False)
    assert (folder / "tokenizer.json").read_bytes() == \
        (factory.TINY_HF / "tokenizer.json").read_bytes()
    config = random_checkpoint.tiny_text_config(vocab_size=600, engram_compressed_vocab_size=300)
    folder = factory.write_checkpoint(tmp_path / "b", config)
    token_map = json.loads((folder / "engram_token_map.json").read_text())
    assert len(token_map) == 600 and max(token_map) == 299
    assert not (folder / "tokenizer.json").exists()


def test_package_generator_needs_the_tokenizer_first(tmp_path):
    """The demo's writer sizes Engram from the folder's tokenizer.json: without one it refuses."""
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        random_checkpoint.write_checkpoint(tmp_path)
    assert not list(tmp_path.iterdir())


def test_demo_tokenizer(tmp_path):
    write_demo_tokenizer(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (cf.BOS, cf.EOS, cf.PAD, *CHAT_SPECIALS)}
    assert list(ids.values()) == [0, 1, 2, *range(504, 512)] and len(tokenizer) == 512
    assert tokenizer.missing_chat_tokens == [] and tokenizer.eos_token_ids == {1}
    text = "Zürich 東京 🙂, two plus two"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert len(tokenizer.encode("two plus two", add_special_tokens=False)) < 12  # merges


def test_demo_checkpoint_is_built_once(demo, tmp_path):
    folder, root = demo
    assert folder == root / "mlx_v41" / "demo-v1" and (folder / MARKER).is_file()
    stamp = (folder / "config.json").stat().st_mtime_ns
    assert ensure_demo_checkpoint() == folder
    assert (folder / "config.json").stat().st_mtime_ns == stamp
    config = json.loads((folder / "config.json").read_text())
    assert config["image_token_id"] == 511 and config["text_config"]["dspark_noise_token_id"] == 504
    assert not list(folder.parent.glob(".*tmp"))  # the staging folder was renamed into place


def test_load_demo_and_generate(demo):
    model, tokenizer = mlx_v41.load("demo")
    assert model.args.text_config.vocab_size == 512
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert prompt.endswith(f"{cf.ASSISTANT}{cf.THINK_START}")  # thinking mode by default
    responses = list(mlx_v41.stream_generate(model, tokenizer, prompt, max_tokens=2))
    assert 1 <= len(responses) <= 2 and responses[-1].finish_reason in ("stop", "length")


@pytest.mark.slow
def test_demo_drafts_plain_greedy(demo):
    """The demo ships the drafter (loaded by default): 64 speculative greedy tokens after a CED
    prefill are plain greedy decoding's (its random drafter is always rejected, so every cycle
    rolls 5 rows back)."""
    model, tokenizer = mlx_v41.load("demo")
    assert "dspark" in model
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    runs = []
    for draft in (None, "dspark"):
        cache = model.make_cache()
        logits = prefill(model, prompt, cache)
        if draft is None:
            steps = generate_step(model, logits, cache, max_tokens=64)
        else:
            stats = DraftStats()
            steps = speculative_steps(model, logits, cache, sampling=Sampling(), max_tokens=64,
                                      stats=stats)
        runs.append([step[0] for step in steps])
    assert len(runs[0]) == 64 and runs[1] == runs[0]
    # k = 5 until the last cycles, which never draft past max_tokens.
    assert stats.accepted == 0 and stats.proposed == sum(min(5, 63 - i) for i in range(64))


def run(args, root):
    env = {**os.environ, "PYTHONPATH": str(REPO), "XDG_CACHE_HOME": str(root)}
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.slow
def test_demo_command_shows_every_stage(demo):
    _, root = demo
    done = run(["-m", "mlx_v41", "demo", "-m", "3"], root)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    out = done.stdout
    assert "text below is random" in out
    for stage in ("[1] checkpoint:", "[2] load:", "[3] chat format:", "[4] prefill + decode",
                  "Prompt:", "Generation:", "Peak memory:", "[5] second turn", "[6] cache:"):
        assert stage in out


def test_demo_flags_have_help_and_are_checked(capsys):
    from mlx_v41.cli.demo import main, setup_arg_parser

    text = " ".join(setup_arg_parser().format_help().split())
    assert "-p PROMPT, --prompt PROMPT the first user message (default" in text
    assert "-m MAX_TOKENS, --max-tokens MAX_TOKENS most tokens per reply (default 16)" in text
    for flags in (["-m", "0"], ["-m", "lots"]):
        with pytest.raises(SystemExit) as exit_info:
            main(flags)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.count("\n") == 1, err
        assert err.startswith("mlx_v41.demo: error: argument -m/--max-tokens: ")


def test_generate_command_with_the_demo_model(demo, capsys):
    from mlx_v41.cli.generate import main

    assert main(["--model", "demo", "-p", "Hi", "-m", "2"]) == 0
    out, err = capsys.readouterr()
    assert err.splitlines()[0] == "demo model: a tiny random checkpoint, so the text is random"
    assert err.splitlines()[1].startswith("experts: resident (") and err.count("\n") == 2
    assert "Generation: " in out and "Peak memory:" in out


@pytest.mark.parametrize("script, expected", [
    ("generate.py", "generated at"),
    ("chat_loop.py", "new prompt tokens, cache at"),
    ("inspect_cache.py", "global-KV bytes per token"),
    ("batch_generate.py", "joins 2 running"),
])
@pytest.mark.slow
def test_examples(demo, script, expected, monkeypatch, capsys):
    folder, _ = demo
    path = REPO / "examples" / script
    assert len(path.read_text().splitlines()) < 50
    stream = mlx_v41.stream_generate

    def short(*args, max_tokens=256, **kwargs):  # 2 tokens are enough to run every line
        return stream(*args, max_tokens=min(max_tokens, 2), **kwargs)

    monkeypatch.setattr(mlx_v41, "stream_generate", short)
    monkeypatch.setattr(sys, "argv", [str(path), str(folder)])
    runpy.run_path(str(path), run_name="__main__")
    assert expected in capsys.readouterr().out
