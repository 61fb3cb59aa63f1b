"""Load-time overrides of the sparse attention (`load_model(overrides=...)`, the CLI flags):
a smaller top-k, candidate pool or window changes what a long enough prompt attends, the
checkpoint's own values change nothing (bit for bit), a prompt cache remembers them, and a value
the weights cannot honour is refused naming its key. On the CPU's reference ops (exact
equalities)."""

import mlx.core as mx
import pytest

import mlx_v41
from mlx_v41.cache.layer import CacheError
from mlx_v41.cli.args import ArgumentParser, add_override_arguments, model_overrides
from mlx_v41.cli.generate import main as generate_main
from mlx_v41.kernels import Kernels
from mlx_v41.model.config import ConfigError

from conftest import golden_checkpoint, without_plan

pytestmark = pytest.mark.usefixtures("cpu")

GOLDEN = golden_checkpoint("tiny")  # window 16, index_topk 16, pool 8 blocks of 4 rows


@pytest.fixture(scope="module")
def prompt():
    # 64 positions: 32 ratio-2 rows and 64 ratio-1 rows (16 pool blocks) exceed every default
    return (mx.arange(64, dtype=mx.int32)[None] * 7 + 3) % 500


@pytest.fixture(scope="module")
def logits(tiny_ops, prompt):
    return tiny_ops(prompt)


def _model(tiny_model, **overrides):
    return tiny_model(Kernels(use=False), overrides=overrides)


@pytest.mark.parametrize("overrides", [{"index_topk": 4}, {"candidate_topk_blocks": 2},
                                       {"sliding_window": 8}])
def test_smaller_values_change_the_logits_of_a_long_prompt(tiny_model, prompt, logits,
                                                            overrides):
    model = _model(tiny_model, **overrides)
    key, value = next(iter(overrides.items()))
    assert getattr(model.cfg, key) == value and model.overrides == overrides
    changed = model(prompt)
    assert not mx.allclose(changed, logits)
    # the first positions see fewer rows than any of these limits: the same logits there
    assert mx.array_equal(changed[:, :4], logits[:, :4])


def test_the_checkpoint_values_change_nothing(tiny_model, prompt, logits):
    model = _model(tiny_model, index_topk=16, candidate_topk_blocks=8, sliding_window=16)
    assert model.overrides == {}
    assert mx.array_equal(model(prompt), logits)


def test_a_smaller_window_sizes_the_rings_and_stays_exact_across_chunks(tiny_model, prompt):
    model = _model(tiny_model, sliding_window=8)
    cache = model.make_cache()
    assert cache[0].window.capacity == 2 * 8
    chunks = [model(prompt[:, a:b], cache=cache) for a, b in ((0, 21), (21, 22), (22, 64))]
    assert mx.array_equal(mx.concatenate(chunks, axis=1), model(prompt))


def test_a_prompt_cache_remembers_the_overrides(tiny_model, tiny_ops, prompt, tmp_path):
    small = _model(tiny_model, index_topk=4)
    cache = small.make_cache()
    small(prompt[:, :40], cache=cache)
    path = tmp_path / "topk4.safetensors"
    mlx_v41.save_prompt_cache(path, cache, small)
    assert mlx_v41.load_prompt_cache(path, _model(tiny_model, index_topk=4))[0].offset == 40
    with pytest.raises(CacheError) as refused:
        mlx_v41.load_prompt_cache(path, tiny_ops)
    message = str(refused.value)
    assert "\n" not in message and "index_topk=4" in message and "this model: none" in message
    with pytest.raises(CacheError, match="index_topk=4; this model: index_topk=8"):
        mlx_v41.load_prompt_cache(path, _model(tiny_model, index_topk=8))


def test_a_cache_without_overrides_loads_into_the_checkpoints_values(tiny_model, tiny_ops,
                                                                     prompt, tmp_path):
    cache = tiny_ops.make_cache()
    tiny_ops(prompt[:, :20], cache=cache)
    path = tmp_path / "plain.safetensors"
    mlx_v41.save_prompt_cache(path, cache, tiny_ops)
    same = _model(tiny_model, index_topk=16)
    assert mlx_v41.load_prompt_cache(path, same)[0].offset == 20
    with pytest.raises(CacheError, match="sliding_window=8"):
        mlx_v41.load_prompt_cache(path, _model(tiny_model, sliding_window=8))


@pytest.mark.parametrize("overrides, words", [
    ({"index_topks": 4}, "overrides.index_topks: not a load-time override"),
    ({"index_topk": 0}, "overrides.index_topk: must be >= 1"),
    ({"candidate_topk_blocks": -3}, "overrides.candidate_topk_blocks: must be >= 1"),
    ({"sliding_window": 17}, "overrides.sliding_window: 17 exceeds 16, the checkpoint's window"),
    ({"index_topk": "4"}, "overrides.index_topk: expected an integer"),
    ({"sliding_window": True}, "overrides.sliding_window: expected an integer"),
    ({"index_topk": 1048577}, "overrides.index_topk: 1048577 exceeds 1048576"),
    ({"candidate_topk_blocks": 262145}, "overrides.candidate_topk_blocks: 262145 exceeds 262144"),
])
def test_overrides_the_weights_cannot_honour_are_refused(overrides, words):
    with pytest.raises(ConfigError) as refused:
        mlx_v41.load_model(GOLDEN, overrides=overrides)
    assert words in str(refused.value) and "\n" not in str(refused.value)


def test_load_takes_the_overrides_too():
    model, _ = mlx_v41.load(str(GOLDEN), overrides={"candidate_topk_blocks": 3})
    assert model.cfg.candidate_topk_blocks == 3 and model.overrides == {"candidate_topk_blocks": 3}
    with pytest.raises(ConfigError, match="overrides: expected a dict"):
        mlx_v41.load(str(GOLDEN), overrides=[("index_topk", 3)])


def test_the_flags_give_the_overrides():
    parser = ArgumentParser(prog="x")
    add_override_arguments(parser)
    args = parser.parse_args(["--index-topk", "64", "--candidate-blocks", "512",
                              "--sliding-window", "96"])
    assert model_overrides(args) == {"index_topk": 64, "candidate_topk_blocks": 512,
                                     "sliding_window": 96}
    assert model_overrides(parser.parse_args([])) is None


@pytest.mark.parametrize("flag", ["--index-topk", "--candidate-blocks", "--sliding-window"])
def test_a_flag_below_one_is_a_one_line_argument_error(flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        generate_main(["--model", str(GOLDEN), flag, "0"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and flag in err and err.count("\n") == 1


def test_generate_refuses_a_window_wider_than_the_checkpoints(capsys):
    assert generate_main(["--model", str(GOLDEN), "--sliding-window", "32", "-m", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: overrides.sliding_window: 32 exceeds 16")
    assert err.count("\n") == 1


def test_generate_runs_with_overrides_and_refuses_another_topks_cache(capsys, tmp_path):
    path = tmp_path / "prompt.safetensors"
    common = ["--model", str(GOLDEN), "-p", "Hello there", "-m", "2", "--no-thinking",
              "--prompt-cache-file", str(path)]
    assert generate_main([*common, "--index-topk", "4", "--sliding-window", "8"]) == 0
    assert path.is_file()
    assert generate_main([*common, "--index-topk", "4", "--sliding-window", "8"]) == 0
    capsys.readouterr()
    assert generate_main(common) == 1
    err = without_plan(capsys.readouterr().err)
    assert "other sparse-attention overrides (index_topk=4, sliding_window=8" in err
    assert err.count("\n") == 1


def test_a_window_too_small_to_undo_a_draft_block_leaves_the_drafter_out(tiny_model):
    # a verification rolls back up to dspark_block_size (5) tokens: the rings need window >= 4
    assert "dspark" in _model(tiny_model, sliding_window=4)
    assert "dspark" not in _model(tiny_model, sliding_window=3)
    with pytest.raises(ConfigError, match="overrides.sliding_window: 3 is too small for the "
                                          "DSpark drafter"):
        mlx_v41.load_model(GOLDEN, dspark=True, overrides={"sliding_window": 3})


def test_chat_loads_with_the_overrides(monkeypatch, capsys):
    import io
    import sys

    from mlx_v41.cli.chat import main as chat_main

    loaded = []

    def load(*args, **options):
        model, tokenizer = mlx_v41.load(*args, **options)
        loaded.append(model)
        return model, tokenizer

    monkeypatch.setattr(sys.modules["mlx_v41.cli.chat"], "load", load)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\n"))
    assert chat_main(["--model", str(GOLDEN), "-m", "2", "--candidate-blocks", "2"]) == 0
    assert loaded[0].overrides == {"candidate_topk_blocks": 2}
