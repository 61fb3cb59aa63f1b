"""mlx-lm runs a folder written by `mlx_v41.convert` through the folder's entry module
(config.json `model_file`, tokenizer_config.json `auto_map`; mlx_v41.checkpoint.for_mlx_lm).

* in process: `mlx_lm.utils.load_model(folder, trust_remote_code=True)` gives our model, loaded
  by `load_model` (mlx-lm's own read of the weights dropped unread), whose logits equal
  `mlx_v41.load_model`'s bit for bit, and whose greedy tokens through mlx-lm's `generate_step`
  (ragged prefill chunks) equal `mlx_v41.stream_generate`'s; mlx-lm's prompt-cache store trims
  our caches exactly or not at all; the tokenizer class renders the V4.1 chat format;
* the real commands as subprocesses (slow): `mlx_lm generate`, `mlx_lm chat` (stdin) and
  `mlx_lm server` (one chat completion over HTTP), each giving mlx_v41's own greedy text;
* without `--trust-remote-code`, and for the published layout, mlx-lm refuses (its messages).

No `cpu` fixture: the subprocesses run on the default device, so the expected texts are
computed on it too, with the default kernels.
"""

from __future__ import annotations

import ast
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_model as mlx_lm_load_model

import mlx_v41
from conftest import golden_checkpoint
from mlx_v41.checkpoint.for_mlx_lm import ENTRY_FILE, V41TokenizerFast
from mlx_v41.convert import convert
from mlx_v41.model.engram import EngramRows

GOLDEN = golden_checkpoint("tiny")
PROMPT = [0, 5, 9, 300, 17, 4, 4, 4, 100, 200, 300, 400, 7, 8, 9, 10]
MESSAGES = [{"role": "user", "content": "Hello there"}]
CHAT_VECTORS = Path(__file__).parent / "data" / "chat_vectors.json"  # the official renders
MAX_TOKENS = 12
RING = 32  # the tiny config's window ring (2 x sliding_window 16): the exact-trim horizon
SERVER_START_S = 120


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return convert(GOLDEN, tmp_path_factory.mktemp("converted") / "v41",
                   progress=False, log=lambda line: None)


@pytest.fixture(scope="module")
def ours(folder):
    """mlx_v41's own (model, tokenizer) of the converted folder."""
    return mlx_v41.load(folder)


@pytest.fixture(scope="module")
def theirs(folder):
    """The folder as mlx-lm loads it."""
    model, _ = mlx_lm_load_model(folder, trust_remote_code=True)
    return model


def greedy_text(ours, messages, max_tokens=MAX_TOKENS, cache=None) -> str:
    model, tokenizer = ours
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return "".join(r.text for r in mlx_v41.stream_generate(
        model, tokenizer, ids, max_tokens=max_tokens, prompt_cache=cache))


def test_folder_names_its_entry_module(folder):
    config = json.loads((folder / "config.json").read_text())
    assert config["model_file"] == ENTRY_FILE
    auto_map = json.loads((folder / "tokenizer_config.json").read_text())["auto_map"]
    assert auto_map == {"AutoTokenizer": [None, "mlx_v41_model.V41TokenizerFast"]}
    tree = ast.parse((folder / ENTRY_FILE).read_text())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert imported == ["mlx_v41.checkpoint.for_mlx_lm"]
    assert not any(isinstance(n, (ast.Import, ast.ClassDef, ast.FunctionDef))
                   for n in ast.walk(tree))


def test_mlx_lm_load_gives_our_model_and_logits(folder, ours, theirs):
    model, _ = ours
    assert type(theirs.v41) is type(model)
    ids = mx.array([PROMPT])
    assert mx.array_equal(theirs(ids), model(ids)).item()
    # no drafter (mlx-lm feeds none); Engram tables memory-mapped rows, not arrays
    assert "dspark" not in theirs.v41
    loaded = dict(tree_flatten(theirs.v41.parameters()))
    for i in theirs.v41.args.text_config.engram_layer_ids:
        assert isinstance(theirs.layers[i].engram.embed.storage, EngramRows)
    assert not any(".engram.embed" in k for k in loaded)


def rchar() -> int:
    """Bytes this process has read through read syscalls (Linux)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux /proc/self/io")
def test_mlx_lm_load_reads_no_more_than_ours(folder, theirs):
    """mlx-lm's lazy reads of model-*.safetensors are dropped unread: its load reads what
    `load_model` reads, not the weights twice (nor the Engram tables, which are mapped)."""
    def read_by(load):
        before = rchar()
        load()
        return rchar() - before

    ours = read_by(lambda: mlx_v41.load_model(folder, dspark=False, vision=False))
    mlx_lm = read_by(lambda: mlx_lm_load_model(folder, trust_remote_code=True))
    weights = sum(p.stat().st_size for p in folder.glob("model-*.safetensors"))
    print(f"bytes read: load_model {ours}, mlx-lm {mlx_lm}, weights {weights}")
    assert mlx_lm < ours + weights / 10


@pytest.mark.slow
def test_mlx_lm_generate_step_matches_our_greedy_stream(ours, theirs):
    """mlx-lm prefills in chunks (all but the last token) and then decodes one token a step;
    its greedy tokens equal mlx_v41's (a prefill step of 7 splits the prompt raggedly)."""
    model, tokenizer = ours
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    expected = [r.token for r in mlx_v41.stream_generate(model, tokenizer, ids,
                                                         max_tokens=MAX_TOKENS)]
    tokens = [t for t, _ in generate_step(mx.array(ids), theirs, max_tokens=MAX_TOKENS,
                                          prefill_step_size=7)]
    assert tokens == expected


def logits_after(model, tokens, cache) -> mx.array:
    return model(mx.array([tokens]), cache=cache)[:, -1]


def test_prompt_cache_store_trims_exactly_or_not_at_all(theirs):
    """mlx-lm's prompt-cache store trims an entry longer than the request without reading the
    count back: our caches say they are trimmable only while any trim is exact (nothing has
    left the window ring), so a long entry is not reused rather than reused wrongly."""
    store = LRUPromptCache()
    short = PROMPT + [11, 12]  # 18 tokens, within the ring
    cache = make_prompt_cache(theirs)
    theirs(mx.array([short]), cache=cache)
    store.insert_cache("m", short, cache)
    reused, rest = store.fetch_nearest_cache("m", PROMPT + [13])
    assert reused[0].offset == len(PROMPT) and rest == [13]
    fresh = make_prompt_cache(theirs)
    theirs(mx.array([PROMPT]), cache=fresh)
    assert mx.array_equal(logits_after(theirs, rest, reused),
                          logits_after(theirs, [13], fresh)).item()

    store = LRUPromptCache()
    long = PROMPT * 3  # 48 tokens: the ring has overwritten its first rows
    cache = make_prompt_cache(theirs)
    theirs(mx.array([long]), cache=cache)
    assert not cache[0].is_trimmable()
    store.insert_cache("m", long, cache)
    reused, rest = store.fetch_nearest_cache("m", long[:RING] + [13])
    assert reused is None and rest == long[:RING] + [13]


def test_tokenizer_class_renders_the_chat_format(folder):
    """mlx-lm's wrapper over the folder's tokenizer class renders the official chat vectors'
    prompts (thinking by default at effort 75, chat, effort max)."""
    wrapped = TokenizerWrapper(V41TokenizerFast.from_pretrained(str(folder)))
    assert wrapped.has_chat_template and wrapped.has_thinking
    hi = [{"role": "user", "content": "Hi"}]
    vectors = {(c["thinking_mode"], c["reasoning_effort"]): c["prompt"]
               for c in json.loads(CHAT_VECTORS.read_text("utf-8"))["cases"]
               if c["messages"] == hi}
    for kwargs, key in (({}, ("thinking", None)), ({"enable_thinking": False}, ("chat", None)),
                        ({"reasoning_effort": "max"}, ("thinking", "max"))):
        ids = wrapped.apply_chat_template(hi, add_generation_prompt=True, **kwargs)
        assert wrapped.decode(ids) == vectors[key], kwargs


def test_load_options_through_model_config(folder):
    model, _ = mlx_lm_load_model(folder, trust_remote_code=True,
                                 model_config={"mlx_v41": {"prefill_mode": "full"}})
    assert model.v41.prefill_mode == "full" and "dspark" not in model.v41
    with pytest.raises(ValueError, match="mlx_v41.expert_budget: not a load_model option"):
        mlx_lm_load_model(folder, trust_remote_code=True,
                          model_config={"mlx_v41": {"expert_budget": "1GB"}})


def test_mlx_lm_refuses_without_trust_and_the_published_layout(folder):
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        mlx_lm_load_model(folder)
    # mlx-lm's own deepseek_v41 port: the documented refusal of the published layout
    with pytest.raises(ValueError, match="engram memory"):
        mlx_lm_load_model(GOLDEN)


# ---------------------------------------------------------------- the commands


def run_mlx_lm(tmp_path, *args, stdin=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlx_lm", *args], input=stdin,
                          capture_output=True, text=True, timeout=timeout, env=env(tmp_path))


def env(tmp_path) -> dict:
    """Offline, transformers' copies of remote code kept in tmp, no colours."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "hf"),
            "NO_COLOR": "1", "TERM": "dumb", "COLUMNS": "100"}


@pytest.mark.slow
def test_mlx_lm_generate_command(folder, ours, tmp_path):
    done = run_mlx_lm(tmp_path, "generate", "--model", str(folder), "--trust-remote-code",
                      "-p", MESSAGES[0]["content"], "--max-tokens", str(MAX_TOKENS))
    assert done.returncode == 0, done.stderr
    text = done.stdout.split("==========\n", 1)[1].rsplit("\n==========", 1)[0]
    assert text == greedy_text(ours, MESSAGES)
    assert f"Generation: {MAX_TOKENS} tokens" in done.stdout


def printable(text: str) -> str:
    return "".join(c for c in text if c.isprintable())


@pytest.mark.slow
def test_mlx_lm_chat_command(folder, ours, tmp_path):
    """Two turns on one continuing cache (mlx-lm's chat renders each turn alone)."""
    turns = ["Hello", "Second turn"]
    done = run_mlx_lm(tmp_path, "chat", "--model", str(folder), "--trust-remote-code",
                      "--max-tokens", "8", stdin="\n".join(turns + ["q"]) + "\n")
    assert done.returncode == 0, done.stderr
    cache = ours[0].make_cache()
    replies = [greedy_text(ours, [{"role": "user", "content": t}], 8, cache) for t in turns]
    shown = printable(done.stdout)
    assert all(printable(r) and printable(r) in shown for r in replies), (replies, shown)
    assert done.stdout.count("8 tokens") == 2 and "bye" in done.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, path: str, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def wait_until_up(process, port: int) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read()
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5).close()
            return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"mlx_lm server did not answer within {SERVER_START_S} s")


@pytest.mark.slow
def test_mlx_lm_server_command(folder, ours, tmp_path):
    """Requests are served one at a time (our caches have no `merge`, so mlx-lm does not
    batch them); the reply starts in the reasoning the prompt opened."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "mlx_lm", "server", "--model",
                                str(folder), "--trust-remote-code", "--port", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env=env(tmp_path))
    try:
        wait_until_up(process, port)
        body = {"messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0}
        for _ in range(2):  # the second one meets the first one's cache in mlx-lm's store
            reply = post(port, "/v1/chat/completions", body)
            message = reply["choices"][0]["message"]
            text = (message.get("reasoning") or "") + (message.get("content") or "")
            assert text == greedy_text(ours, MESSAGES)
            assert reply["usage"]["completion_tokens"] == MAX_TOKENS
    finally:
        process.terminate()
        process.wait(timeout=30)
