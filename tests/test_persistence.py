"""Prompt-cache files: tied to the weights, the prefill mode and the config (not the config
alone), versioned, saved atomically under any file name."""

from __future__ import annotations

import hashlib
import json

import mlx.core as mx
import pytest

import mlx_v41
from mlx_v41 import CacheError
from mlx_v41.cache import persistence
from mlx_v41.convert import convert
from mlx_v41.model.model import Model
from checkpoint_factory import write_checkpoint
from conftest import golden_checkpoint

# Exact equalities between different computations: they hold on the CPU backend.
pytestmark = pytest.mark.usefixtures("cpu")

GOLDEN = golden_checkpoint("tiny")
QUIET = dict(progress=False, log=lambda line: None)


@pytest.fixture(scope="module")
def model():
    return mlx_v41.load_model(GOLDEN)


@pytest.fixture(scope="module")
def prompt_cache(model):
    cache = model.make_cache()
    model.prefill(mx.array([[0, 5, 9, 300, 17, 4, 4, 100, 7]]), cache)
    return cache


def saved(path, model, cache=None):
    mlx_v41.save_prompt_cache(path, cache or model.make_cache(), model, {"turns": "1"})
    return path


def refused(path, model, what: str) -> str:
    """Loading `path` into `model` fails with a one-line CacheError naming `what`."""
    with pytest.raises(CacheError) as info:
        mlx_v41.load_prompt_cache(path, model)
    message = str(info.value)
    assert "\n" not in message and str(path) in message and what in message, message
    return message


def test_cache_from_other_weights_with_the_same_config_is_refused(tmp_path, model):
    # seed 1: same config, same tensor names, shapes and dtypes (same shard headers), other values
    other = mlx_v41.load_model(write_checkpoint(tmp_path / "hf", seed=1))
    assert other.args == model.args
    refused(saved(tmp_path / "p.safetensors", model), other, "weights")


def test_cache_from_an_in_memory_model_is_refused_by_another(tmp_path, model):
    first, second = Model(model.args), Model(model.args)  # random initial weights each
    path = saved(tmp_path / "p.safetensors", first)
    assert mlx_v41.load_prompt_cache(path, first)[0].offset == 0
    refused(path, second, "weights")


def test_official_cache_is_refused_by_a_requantized_conversion(tmp_path, model):
    out = convert(GOLDEN, tmp_path / "mlx", quantize=True, q_mode="mxfp8", drop_vision=True,
                  drop_dspark=True, **QUIET)
    requantized = mlx_v41.load_model(out)
    refused(saved(tmp_path / "official.safetensors", model), requantized, "weights")
    refused(saved(tmp_path / "requantized.safetensors", requantized), model, "weights")


@pytest.mark.parametrize("kwargs", [{"prefill_mode": "ced_replay"}, {"ced_rollback": 0}])
def test_cache_from_another_prefill_mode_is_refused(tmp_path, model, kwargs):
    other = mlx_v41.load_model(GOLDEN, **kwargs)
    message = refused(saved(tmp_path / "p.safetensors", other), model, "prefill mode")
    assert str(next(iter(kwargs.values()))) in message
    refused(saved(tmp_path / "q.safetensors", model), other, "prefill mode")


def test_same_checkpoint_loaded_twice_accepts_the_cache(tmp_path, model, prompt_cache):
    path = saved(tmp_path / "p.safetensors", model, prompt_cache)
    loaded, meta = mlx_v41.load_prompt_cache(path, mlx_v41.load_model(GOLDEN),
                                             return_metadata=True)
    assert meta == {"turns": "1"} and loaded[0].offset == prompt_cache[0].offset


def test_old_format_file_is_refused(tmp_path, model):
    path = tmp_path / "old.safetensors"
    text = json.dumps(model.args.to_dict()["text_config"], sort_keys=True)
    fingerprint = hashlib.sha256(text.encode()).hexdigest()  # v1: the text config only
    mx.save_safetensors(str(path), {"0.window": mx.zeros((1, 1))}, metadata={
        "format": "mlx_v41.prompt_cache.v1", "fingerprint": fingerprint, "layers": "[]",
        "user": "{}"})
    message = refused(path, model, "format v1 from another mlx_v41 version")
    assert "reads v2" in message


@pytest.mark.parametrize("name", ["p.cache", "x.bin", "noext", "p.safetensors"])
def test_any_file_name_round_trips(tmp_path, model, prompt_cache, name):
    path = saved(tmp_path / name, model, prompt_cache)
    assert [p.name for p in tmp_path.iterdir()] == [name]
    loaded, meta = mlx_v41.load_prompt_cache(path, model, return_metadata=True)
    assert meta == {"turns": "1"}
    step = mx.array([[11]], dtype=mx.int32)
    assert mx.array_equal(model(step, cache=mlx_v41.copy_cache(prompt_cache)),
                          model(step, cache=loaded))


def test_failed_save_leaves_the_old_file(tmp_path, model, prompt_cache, monkeypatch):
    path = saved(tmp_path / "p.cache", model, prompt_cache)
    before = path.read_bytes()

    def broken(file, arrays, metadata=None):
        with open(file, "wb") as f:
            f.write(b"half a file")
        raise RuntimeError("disk full")

    monkeypatch.setattr(mx, "save_safetensors", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        mlx_v41.save_prompt_cache(path, model.make_cache(), model)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["p.cache"]
    assert mlx_v41.load_prompt_cache(path, model)[0].offset == prompt_cache[0].offset


def test_fingerprints_name_what_differs(model):
    """The metadata keeps the three parts apart so that a mismatch names its part."""
    info = persistence.fingerprints(model)
    assert set(info) == {"config", "weights", "prefill"}
    assert json.loads(info["prefill"]) == {"prefill_mode": "ced",
                                           "ced_rollback": model.ced_rollback}
    assert info["weights"] == model.weights_fingerprint


def test_checkpoint_reader_has_no_writer():
    """Prompt caches are the only safetensors the package writes (the converter has its own
    writer); the reader's old `save_safetensors` appended `.safetensors` to its temporary name
    and then renamed a file that did not exist."""
    from mlx_v41.checkpoint import safetensors_io
    assert not hasattr(safetensors_io, "save_safetensors")
