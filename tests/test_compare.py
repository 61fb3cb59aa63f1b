"""Comparison of two settings (`generation.compare`, `mlx_v41.compare`) and the two examples
built on it: a setting against itself gives exactly KL 0, full agreement, a flat ladder and
the whole greedy prefix; known perturbations (a smaller top-k, the bf16 head, the bounded
replay) give the divergences a numpy computation from the two models' logits gives; bad data,
another tokenizer or vocabulary and bad overrides are refused in one line. On the CPU."""

import dataclasses
import json
import re
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest

import mlx_v41
from mlx_v41.cli.compare import main
from mlx_v41.generation.compare import (CompareError, check_same_tokens, compare, kl_terms,
                                        record_reference)
from mlx_v41.generation.perplexity import make_sequences, read_documents, scored_logits
from mlx_v41.kernels import Kernels

from checkpoint_factory import write_checkpoint
from conftest import corpus, golden_checkpoint, slow, writable_copy
from mlx_v41.checkpoint.random_checkpoint import tiny_text_config

pytestmark = pytest.mark.usefixtures("cpu")

REPO = Path(__file__).resolve().parents[1]
GOLDEN = golden_checkpoint("tiny")  # vocabulary 512, window 16, index top-16
PROMPTS = ([0, 5, 9, 300, 17, 4, 4, 4, 100, 200, 300, 400, 7, 8, 9, 10, 11, 12, 13, 14],)


def tiny(**kwargs):
    model = mlx_v41.load_model(GOLDEN, dspark=False, vision=False, **kwargs)
    model.kernels = Kernels(use=False)
    return model


@pytest.fixture(scope="module")
def reference():
    return tiny()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = corpus(tmp_path_factory.mktemp("data") / "corpus.jsonl")
    tokenizer = mlx_v41.load(str(GOLDEN))[1]
    return make_sequences(tokenizer, read_documents(path), 48, 3, seed=3)


@pytest.fixture(scope="module")
def exact_record(reference, data):
    return record_reference(reference, data, batch_size=2, kl_top_k=0, prompts=PROMPTS,
                            max_tokens=6)


def numpy_kl(reference_logits, test_logits) -> np.ndarray:
    """KL(p ‖ q) per position over the whole vocabulary, float64 log_softmax in numpy."""
    def log_softmax(z):
        z = np.array(z, dtype=np.float64).reshape(-1, z.shape[-1])
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))
    lp, lq = log_softmax(reference_logits), log_softmax(test_logits)
    return np.sum(np.exp(lp) * (lp - lq), axis=-1)


def assert_identical(result, max_tokens: int = 6):
    assert result.kl_mean == 0.0 and result.kl_p99 == 0.0 and result.kl_max == 0.0
    assert result.top1_agreement == 1.0
    assert result.argmax_logprob_delta == 0.0 and result.target_logprob_delta == 0.0
    assert result.perplexity == result.reference_perplexity
    assert result.ladder and all(rms == 0.0 and cos == 1.0 for _, rms, cos in result.ladder)
    assert result.first_difference == [max_tokens] * len(PROMPTS)


@pytest.mark.parametrize("kl_top_k", [0, slow(8)])
def test_a_setting_against_itself_is_identical(reference, data, exact_record, kl_top_k):
    record = exact_record if kl_top_k == 0 else record_reference(
        reference, data, batch_size=3, kl_top_k=kl_top_k, prompts=PROMPTS, max_tokens=6)
    result = compare(tiny(), record, batch_size=1)  # another batching, a fresh model
    assert_identical(result)
    assert result.positions == 3 * 47 and result.kl_exact == (kl_top_k == 0)
    assert [layer for layer, _, _ in result.ladder] == list(range(12))


@pytest.mark.slow
def test_a_smaller_top_k_diverges_by_the_numpy_kl(reference, data, exact_record):
    test = tiny(overrides={"index_topk": 4})
    result = compare(test, exact_record, batch_size=2)
    expected = numpy_kl(reference(data[:, :-1]), test(data[:, :-1]))
    assert result.kl_mean > 0.01
    np.testing.assert_allclose(result.kl_mean, expected.mean(), rtol=1e-4)
    np.testing.assert_allclose(result.kl_p99, np.percentile(expected, 99), rtol=1e-4)
    agree = np.mean(np.argmax(np.array(reference(data[:, :-1])), -1)
                    == np.argmax(np.array(test(data[:, :-1])), -1))
    assert result.top1_agreement == agree < 1.0
    # the first layers run no top-k over more than 4 rows yet: the ladder starts flat
    rms = [r for _, r, _ in result.ladder]
    assert rms[:3] == [0.0, 0.0, 0.0] and rms[-1] > 0.05
    # the top-k record's KL is a lower bound of the exact one, per position
    topk = record_reference(reference, data, batch_size=2, kl_top_k=8, ladder_samples=0)
    lower = compare(test, topk, batch_size=2)
    assert 0 < lower.kl_mean <= result.kl_mean and not lower.ladder


def test_kl_with_a_tail_bucket_on_a_hand_example():
    p, q = np.log([0.5, 0.3, 0.2]), np.log([0.25, 0.25, 0.5])
    exact = kl_terms(p[None], q[None], True)[0]
    assert exact == pytest.approx(np.sum(np.exp(p) * (p - q)))
    bucket = kl_terms(p[None, :2], q[None, :2], False)[0]
    assert bucket == pytest.approx(exact)  # one token left out: the bucket is that token
    merged = kl_terms(p[None, :1], q[None, :1], False)[0]
    assert 0 < merged < exact


@pytest.mark.slow
def test_the_bf16_head_changes_the_logits_not_the_streams(reference, data, exact_record):
    test = tiny(head_dtype="bfloat16")
    result = compare(test, exact_record, batch_size=2)
    expected = numpy_kl(reference(data[:, :-1]), test(data[:, :-1]))
    assert result.kl_mean > 0
    # fp32 log-probabilities resolve KL to about 1e-6 nats
    np.testing.assert_allclose(result.kl_mean, expected.mean(), rtol=1e-3, atol=1e-6)
    assert all(rms == 0.0 and cos == 1.0 for _, rms, cos in result.ladder)


@pytest.mark.slow
def test_prefill_modes_differ_only_where_the_replay_approximates(data):
    prompts = [data[0, :40].tolist()]
    record = record_reference(tiny(), data, context=36, kl_top_k=0, prompts=prompts,
                              max_tokens=4)
    full = compare(tiny(prefill_mode="full"), record)
    assert full.kl_max == 0.0 and full.first_difference == [4]
    replay = compare(tiny(prefill_mode="ced_replay"), record)
    assert replay.kl_max > 0  # the prompt's last prediction and the rows after it read it
    logits, _ = scored_logits(tiny(prefill_mode="ced_replay"), data, 36)
    expected = numpy_kl(scored_logits(tiny(), data, 36)[0], logits)
    np.testing.assert_allclose(replay.kl_mean, expected.mean(), rtol=1e-4)


def test_another_vocabulary_or_tokenization_is_refused(exact_record):
    other = dataclasses.replace(exact_record, vocab_size=1024)
    with pytest.raises(CompareError, match="vocabulary has 512 tokens, the reference's 1024"):
        compare(tiny(), other)
    data = exact_record.data.copy()
    data[1, 5] += 1
    with pytest.raises(CompareError, match=r"sequence 1, position 5\): the two tokenizers"):
        check_same_tokens(data, exact_record.data)
    with pytest.raises(CompareError, match="cuts the data into 2 sequences"):
        check_same_tokens(data[:2], exact_record.data)


def cli(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


SMALL = ("--sequence-length", 40, "--num-samples", 2, "--prompts", 1, "--prompt-length", 20,
         "-m", 3)
SMALL_STR = [str(a) for a in SMALL]


@pytest.mark.slow
def test_cli_json_against_itself_and_a_perturbation(tmp_path, capsys):
    path = corpus(tmp_path / "c.jsonl")
    code, out, err = cli(capsys, "--model", GOLDEN, "--data-path", path, *SMALL, "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["kl_mean"] == 0.0 and result["top1_agreement"] == 1.0
    assert result["longest_common_prefix"] == 3 and len(result["ladder"]) == 12
    code, out, err = cli(capsys, "--model", GOLDEN, "--reference", GOLDEN, "--data-path", path,
                         *SMALL, "--index-topk", 4)
    assert code == 0, err
    assert "| KL(reference ‖ test) mean | 0.000000 |" not in out
    assert "index_topk=4" in out and "| 11 |" in out


@pytest.mark.slow
def test_cli_reference_flags_apply_to_the_reference(tmp_path, capsys):
    path = corpus(tmp_path / "c.jsonl")
    code, out, _ = cli(capsys, "--model", GOLDEN, "--data-path", path, *SMALL, "--index-topk",
                       4, "--reference-index-topk", 4, "--json")
    assert code == 0 and json.loads(out)["kl_mean"] == 0.0
    assert json.loads(out)["reference_settings"]["overrides"] == {"index_topk": 4}


def other_tokenizer(tmp_path) -> Path:
    """A copy of the tiny checkpoint whose tokenizer has no merges (bytes only)."""
    folder = writable_copy(GOLDEN, tmp_path / "other")
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["model"]["merges"] = []
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return folder


@pytest.mark.parametrize("case, message", [
    ("missing", "missing.jsonl: file not found"),
    ("empty", "empty.txt: the file is empty"),
    ("tokenizer", "the two tokenizers differ"),
    ("vocabulary", "vocabulary has 512 tokens, the reference's 1024"),
    ("window", "test model: overrides.sliding_window: 64 exceeds 16"),
    ("reference_window", "reference: overrides.sliding_window: 64 exceeds 16"),
])
def test_cli_errors_are_one_line(tmp_path, capsys, case, message):
    path = corpus(tmp_path / "c.jsonl")
    (tmp_path / "empty.txt").write_text("")
    argv = {"missing": lambda: ["--data-path", tmp_path / "missing.jsonl"],
            "empty": lambda: ["--data-path", tmp_path / "empty.txt"],
            "tokenizer": lambda: ["--data-path", path, "--reference", other_tokenizer(tmp_path)],
            "vocabulary": lambda: ["--data-path", path, "--reference", write_checkpoint(
                tmp_path / "v", tiny_text_config(vocab_size=1024), engram=False,
                tokenizer_dir=GOLDEN)],
            "window": lambda: ["--data-path", path, "--sliding-window", 64],
            "reference_window": lambda: ["--data-path", path, "--reference-sliding-window", 64],
            }[case]()
    code, out, err = cli(capsys, "--model", GOLDEN, *SMALL, *argv)
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 1 and len(lines) == 1 and message in lines[0], err


@pytest.mark.parametrize("argv, message", [
    (["--sliding-window", "64"], "test model: overrides.sliding_window: 64 exceeds 16"),
    (["--reference", "{tmp}/none"], "reference: {tmp}/none: model folder not found"),
    (["--data-path", "{tmp}"], "{tmp}: a directory, not a file"),
])
def test_cli_checks_before_loading(tmp_path, capsys, monkeypatch, argv, message):
    """Refused before the reference pass (and before any load)."""
    def load(*args, **kwargs):
        raise AssertionError("a model loads before the arguments are checked")

    monkeypatch.setattr(sys.modules["mlx_v41.cli.compare"], "load", load)
    path = corpus(tmp_path / "c.jsonl")
    argv = [a.format(tmp=tmp_path) for a in argv]
    code, _, err = cli(capsys, "--model", GOLDEN, "--data-path", path, *SMALL, *argv)
    assert code == 1 and err.startswith(f"error: {message.format(tmp=tmp_path)}"), err
    assert err.count("\n") == 1


@pytest.mark.parametrize("argv, flag", [
    (["--reference-index-topk", "0"], "--reference-index-topk"),
    (["--context-length", "39"], "--context-length"),
    (["--prefill-mode", "fast"], "--prefill-mode"),
])
def test_cli_argument_errors(capsys, argv, flag):
    with pytest.raises(SystemExit) as exit_:
        main(["--model", str(GOLDEN), "--data-path", "x.txt", *SMALL_STR, *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1 and flag in err



def run_example(name: str, argv: list, monkeypatch, capsys, err=None) -> str:
    """The example's stdout (its stderr appended to `err`)."""
    monkeypatch.setattr(sys, "argv", [name, *map(str, argv)])
    runpy.run_path(str(REPO / "examples" / name), run_name="__main__")
    captured = capsys.readouterr()
    if err is not None:
        err.append(captured.err)
    return captured.out


@pytest.mark.slow
def test_topk_sweep_example(tmp_path, monkeypatch, capsys):
    path = corpus(tmp_path / "c.jsonl")
    out = run_example("topk_sweep.py", [GOLDEN, path, "--topks", "4", "16", "--baseline", 16,
                                        "--sequence-length", 40, "--num-samples", 2,
                                        "--prompts", 1, "--max-tokens", 3], monkeypatch, capsys)
    rows = [line for line in out.splitlines() if line.startswith("| 16 ")]
    assert len(rows) == 1 and "| 0.000000 | 1.0000 |" in rows[0]
    assert "| 4 " in out


@pytest.mark.slow
def test_recipe_ladder_example(tmp_path, monkeypatch, capsys):
    path = corpus(tmp_path / "c.jsonl")
    err = []
    out = run_example("recipe_ladder.py", [GOLDEN, path, "--recipes", "mxfp8", "mixed_3_8",
                                           "--work-dir", tmp_path / "work",
                                           "--sequence-length", 40, "--num-samples", 2,
                                           "--prompts", 1, "--max-tokens", 3],
                      monkeypatch, capsys, err)
    steps = [line.split(" s] ", 1)[1] for line in err[0].splitlines()
             if re.match(r"\[ *\d+ s\] ", line)]  # "[    12 s] a step"
    assert steps[:2] == [f"loading the reference {GOLDEN}", "reference pass: 2 x 40 tokens, "
                         "1 prompts"]
    assert steps[2:] == [f"{recipe} ({n}/2): {what}" for n, recipe in enumerate(
        ("mxfp8", "mixed_3_8"), 1) for what in (f"converting into {tmp_path / 'work' / recipe}",
                                                "comparing with the reference")]
    mxfp8 = [line for line in out.splitlines() if line.startswith("| mxfp8 ")]
    # requantizing to mxfp8 is lossless: the official recipe's logits exactly
    assert len(mxfp8) == 1 and "| 0.000000 | 1.0000 |" in mxfp8[0]
    assert "| mixed_3_8 " in out
