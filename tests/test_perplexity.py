"""Perplexity (`generation.perplexity`, `mlx_v41.perplexity`): exp(mean loss) against the
model's logits in plain numpy, the standard error on a hand example, one setting recomputed
bit for bit, the prompt part that a prefill mode runs, converted folders and overrides, the
command's output, and one-line errors for bad data files. On the CPU's reference ops."""

import math
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

import mlx_v41
from mlx_v41.cli.perplexity import main
from mlx_v41.convert import convert
from mlx_v41.generation.perplexity import (DataError, evaluate_perplexity, make_sequences,
                                           perplexity_stats, read_documents, sequence_losses,
                                           token_losses)
from mlx_v41.kernels import Kernels

from conftest import CORPUS_WORDS, corpus, golden_checkpoint, without_plan

pytestmark = pytest.mark.usefixtures("cpu")

GOLDEN = golden_checkpoint("tiny")  # vocabulary 512, window 16


@pytest.fixture(scope="module")
def loaded():
    model, tokenizer = mlx_v41.load(str(GOLDEN))
    model.kernels = Kernels(use=False)
    return model, tokenizer


@pytest.fixture(scope="module")
def data(loaded, tmp_path_factory):
    path = corpus(tmp_path_factory.mktemp("data") / "corpus.jsonl")
    return make_sequences(loaded[1], read_documents(path), 48, 5, seed=3)


def numpy_losses(logits: mx.array, targets: mx.array) -> np.ndarray:
    """Next-token losses from logits by a float64 log_softmax in numpy."""
    z = np.array(logits, dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    log_softmax = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return -np.take_along_axis(log_softmax, np.array(targets)[..., None], axis=-1)[..., 0]


def test_standard_error_on_a_hand_example():
    ppl, error = perplexity_stats([1.0, 2.0, 3.0, 4.0])
    # mean 2.5; sample variance ((1.5^2 + 0.5^2) * 2) / 3 = 5/3; 4 losses
    assert ppl == pytest.approx(math.exp(2.5), rel=1e-12)
    assert error == pytest.approx(math.exp(2.5) * math.sqrt(5 / 3) / 2, rel=1e-12)
    assert perplexity_stats([0.5])[0] == pytest.approx(math.exp(0.5))
    assert math.isnan(perplexity_stats([0.5])[1])


def test_token_losses_are_the_cross_entropy():
    logits = mx.array(np.random.default_rng(1).normal(size=(2, 3, 7)) * 4, dtype=mx.float32)
    targets = mx.array([[0, 6, 3], [2, 2, 5]])
    np.testing.assert_allclose(np.array(token_losses(logits, targets)),
                               numpy_losses(logits, targets), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_perplexity_is_exp_of_the_mean_loss_of_the_models_logits(loaded, data):
    model, _ = loaded
    result = evaluate_perplexity(model, data, batch_size=2)
    losses = numpy_losses(model(data[:, :-1]), data[:, 1:])
    assert result.tokens == losses.size == 5 * 47 and result.positions == 5 * 47
    assert result.mean_loss == pytest.approx(losses.mean(), rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(losses.mean()), rel=1e-5)
    expected = math.exp(losses.mean()) * losses.std(ddof=1) / math.sqrt(losses.size)
    assert result.standard_error == pytest.approx(expected, rel=1e-4)
    assert result.seconds > 0 and result.tokens_per_second > 0


@pytest.mark.slow
def test_a_setting_equals_its_own_recomputation_at_any_batch_size(loaded, data):
    model, _ = loaded
    first = evaluate_perplexity(model, data, batch_size=2)
    again = evaluate_perplexity(model, data, batch_size=2)
    one_by_one = evaluate_perplexity(model, data, batch_size=1)
    assert (again.perplexity, again.standard_error) == (first.perplexity, first.standard_error)
    assert (one_by_one.perplexity, one_by_one.standard_error) == \
        (first.perplexity, first.standard_error)


@pytest.mark.slow
def test_an_exact_prompt_prefill_scores_what_one_forward_does(loaded, data):
    model, _ = loaded
    whole = sequence_losses(model, data[:2])
    for context, step in ((30, None), (47, 8)):
        part = sequence_losses(model, data[:2], context=context, step_size=step)
        assert part.shape == (2, 48 - context)
        assert mx.array_equal(part, whole[:, context - 1:])  # exact on the CPU
    with pytest.raises(ValueError, match="context must lie in"):
        sequence_losses(model, data[:1], context=48)


@pytest.mark.slow
def test_the_bounded_replay_is_scored_as_an_approximation(data):
    exact = mlx_v41.load_model(GOLDEN, prefill_mode="ced")
    replay = mlx_v41.load_model(GOLDEN, prefill_mode="ced_replay")
    for model in (exact, replay):
        model.kernels = Kernels(use=False)
    a = sequence_losses(exact, data[:2], context=40)
    b = sequence_losses(replay, data[:2], context=40)  # 40 > the window: replay truncates
    assert not mx.allclose(a, b)


@pytest.mark.slow
def test_overrides_and_converted_folders(loaded, data, tmp_path):
    model, _ = loaded
    base = evaluate_perplexity(model, data, batch_size=5)
    small = mlx_v41.load_model(GOLDEN, overrides={"index_topk": 2, "sliding_window": 4})
    small.kernels = Kernels(use=False)
    assert evaluate_perplexity(small, data, batch_size=5).perplexity != base.perplexity
    folder = convert(GOLDEN, tmp_path / "mlx", quantize=True, q_bits=4, drop_vision=True,
                     drop_dspark=True, progress=False, log=lambda line: None)
    quantized, _ = mlx_v41.load(str(folder), overrides={"index_topk": 2})
    result = evaluate_perplexity(quantized, data, batch_size=5)
    assert math.isfinite(result.perplexity) and result.perplexity != base.perplexity


def test_sequences_follow_the_seed_and_the_sample_count(loaded, tmp_path):
    _, tokenizer = loaded
    documents = read_documents(corpus(tmp_path / "c.jsonl"))
    a = make_sequences(tokenizer, documents, 32, 3, seed=1)
    assert a.shape == (3, 32) and a.dtype == mx.int32
    assert mx.array_equal(a, make_sequences(tokenizer, documents, 32, 3, seed=1))
    assert not mx.array_equal(a, make_sequences(tokenizer, documents, 32, 3, seed=2))
    every = make_sequences(tokenizer, documents, 32, -1, seed=1)
    assert every.shape[0] > 3 and mx.array_equal(every[:3], a)
    first = tokenizer.encode_prompt(documents[int(np.random.default_rng(1).permutation(12)[0])])
    assert a[0, :len(first)].tolist() == first[:32]  # BOS, the text, EOS, the next document


def write(path, data: bytes):
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("name, content, words", [
    ("missing.txt", None, "file not found"),
    ("empty.txt", b"  \n\n", "the file is empty"),
    ("latin1.txt", b"good line\ncaf\xe9\n", "line 2: not valid UTF-8 (byte 0xe9)"),
    ("notext.jsonl", b'{"text": "fine"}\n\n{"body": "x"}\n', 'line 3: no "text" field'),
    ("number.jsonl", b'{"text": 5}\n', 'line 1: no "text" field'),
    ("broken.jsonl", b'{"text": "fine"}\n{"text": \n', "line 2: not valid JSON"),
])
def test_bad_files_are_refused_naming_the_file_and_line(tmp_path, name, content, words):
    path = tmp_path / name if content is None else write(tmp_path / name, content)
    with pytest.raises(DataError) as refused:
        read_documents(path)
    message = str(refused.value)
    assert message.startswith(str(path)) and words in message and "\n" not in message


def test_too_few_tokens_for_one_sequence(loaded, tmp_path):
    path = write(tmp_path / "short.txt", b"a few words")
    with pytest.raises(DataError, match=r"short.txt: \d+ tokens, fewer than one sequence of 512"):
        make_sequences(loaded[1], read_documents(path), 512, source=str(path))


def test_cli_prints_the_numbers(tmp_path, capsys):
    path = corpus(tmp_path / "corpus.jsonl")
    code = main(["--model", str(GOLDEN), "--data-path", str(path), "--sequence-length", "40",
                 "--num-samples", "3", "--batch-size", "2", "--index-topk", "4",
                 "--context-length", "20", "--prefill-mode", "full"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "Loaded 3 samples of 40 tokens" in out.err
    assert "Settings: prefill_mode=full, context_length=20, index_topk=4" in out.out
    ppl, error = (float(x) for x in
                  out.out.split("Perplexity: ")[1].split("\n")[0].split(" ± "))
    assert ppl > 1 and error > 0
    for line in ("Mean loss: ", "over 60 tokens", "Tokens per second: ", "Peak memory: "):
        assert line in out.out


@pytest.mark.parametrize("argv, words", [
    (["--data-path", "{tmp}/none.txt"], "none.txt: file not found"),
    (["--data-path", "{tmp}/short.txt"], "short.txt: "),
    (["--data-path", "{tmp}/short.txt", "--sliding-window", "99"],
     "overrides.sliding_window: 99 exceeds 16"),
])
def test_cli_errors_are_one_line(tmp_path, capsys, argv, words):
    write(tmp_path / "short.txt", b"a few words")
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert main(["--model", str(GOLDEN), *argv]) == 1
    err = without_plan(capsys.readouterr().err)
    assert "error: " in err and words in err and err.strip().count("\n") <= 1
    assert err.strip().splitlines()[-1].startswith("error: ")


def test_cli_checks_the_data_file_before_loading(tmp_path, capsys, monkeypatch):
    def load(*args, **kwargs):
        raise AssertionError("the model loads before the data file is checked")

    monkeypatch.setattr(sys.modules["mlx_v41.cli.perplexity"], "load", load)
    for path, words in ((tmp_path / "nope.txt", "file not found"),
                        (tmp_path, "a directory, not a file")):
        assert main(["--model", str(GOLDEN), "--data-path", str(path)]) == 1
        assert capsys.readouterr().err == f"error: {path}: {words}\n"


@pytest.mark.parametrize("argv, flag", [
    (["--context-length", "512"], "--context-length"),
    (["--num-samples", "0"], "--num-samples"),
    (["--sequence-length", "1"], "--sequence-length"),
    (["--index-topk", "0"], "--index-topk"),
])
def test_cli_argument_errors(tmp_path, capsys, argv, flag):
    with pytest.raises(SystemExit) as exit_:
        main(["--model", str(GOLDEN), "--data-path", "x.txt", *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and flag in err and err.count("\n") == 1


def test_console_script():
    text = (GOLDEN.parents[4] / "pyproject.toml").read_text().split("[project.scripts]")[1]
    assert '"mlx_v41.perplexity" = "mlx_v41.cli.perplexity:main"' in text.split("\n[")[0]


@pytest.mark.slow
def test_the_module_runs_in_a_subprocess(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text(" ".join(CORPUS_WORDS * 20))
    done = subprocess.run([sys.executable, "-m", "mlx_v41.cli.perplexity", "--model",
                           str(GOLDEN), "--data-path", str(path), "--sequence-length", "64",
                           "--num-samples", "-1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Perplexity: " in done.stdout and "Peak memory: " in done.stdout
