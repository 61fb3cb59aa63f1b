"""Prompt-cache files: tied to the weights, the prefill mode and the config (not the config
alone), versioned, saved atomically under any file name, refused when their tensor bytes no
longer match the checksums saved with them."""

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


def flip_data_byte(path, at: float = 0.5) -> None:
    """Flip one byte `at` (a fraction) of the way into the file's tensor data (after the
    8-byte header length and the JSON header)."""
    raw = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(raw[:8], "little")
    k = start + int((len(raw) - start) * at)
    raw[k] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_damaged_data_is_refused(tmp_path, model, prompt_cache):
    path = saved(tmp_path / "p.cache", model, prompt_cache)
    flip_data_byte(path)
    message = refused(path, model, "damaged")
    assert "does not match its checksum" in message


def test_file_without_checksums_still_loads(tmp_path, model, prompt_cache):
    """A file saved before the checksums were stored loads unchecked."""
    path = saved(tmp_path / "p.cache", model, prompt_cache)
    arrays, info = mx.load(str(path), format="safetensors", return_metadata=True)
    del info[persistence.CHECKSUMS]
    mx.save_safetensors(str(tmp_path / "old.safetensors"), arrays, metadata=info)
    loaded = mlx_v41.load_prompt_cache(tmp_path / "old.safetensors", model)
    assert loaded[0].offset == prompt_cache[0].offset


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


# ------------------------------------------------------------- across ranks (a stub group)

class StubLink:
    """Rank 0 of a 2-rank group whose rank 1 sends `other` in every `exchange` (and zeros to
    every `all_sum`)."""

    rank, size = 0, 2

    def __init__(self, other: dict):
        self.other = json.dumps(other).encode()

    def all_sum(self, x, what):
        return x

    def all_gather(self, x, what):
        if x.dtype == mx.int32:  # the records' lengths
            return mx.concatenate([x, mx.array([len(self.other)], mx.int32)])
        theirs = self.other + b"\0" * (x.size - len(self.other))
        return mx.concatenate([x, mx.array(list(theirs), mx.uint8)])


def rank0(other: dict):
    """Rank 0 of a 2-rank pipeline split at layer 6."""
    from mlx_v41.distributed.group import RankGroup

    return RankGroup(StubLink(other), [(0, 6), (6, 12)], is_pipeline=True)


def test_a_group_save_lands_only_when_every_rank_wrote(tmp_path, model, prompt_cache):
    from mlx_v41.generation.prompt_reuse import write_prompt_cache

    path = saved(tmp_path / "s.bin", model)  # an older one-process file stays as it was
    before = path.read_bytes()
    with pytest.raises(OSError, match=r"^rank 1: disk full$"):
        write_prompt_cache(path, prompt_cache, model, {}, rank0({"error": "disk full"}))
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["s.bin"]
    write_prompt_cache(path, prompt_cache, model, {"k": "v"}, rank0({"error": None}))
    assert [p.name for p in tmp_path.iterdir()] == ["s.bin"]  # rank 1's is on its machine
    group = json.loads(mx.load(str(path), format="safetensors", return_metadata=True)[1]["group"])
    assert group == {"rank": 0, "size": 2, "split": [[0, 6], [6, 12]]}
    refused(path, model, "made by rank 0 of 2 (pipeline 0-5, 6-11); this is one process")


def test_a_group_load_is_used_only_if_every_rank_read_the_same_save(tmp_path, model,
                                                                    prompt_cache):
    from mlx_v41.distributed.cache_files import SAVE_ID
    from mlx_v41.generation.prompt_reuse import read_prompt_cache, write_prompt_cache

    path = tmp_path / "s.bin"
    write_prompt_cache(path, prompt_cache, model, {"k": "v"}, rank0({"error": None}))
    save = json.loads(mx.load(str(path), format="safetensors",
                              return_metadata=True)[1]["user"])[SAVE_ID]
    cache, meta = read_prompt_cache(path, model, rank0({"error": None, "save": save,
                                                        "budget": 2}))
    assert meta == {"k": "v"} and {c.trim_budget for c in cache} == {2}  # the group's least
    assert cache[0].offset == prompt_cache[0].offset
    for other, message in (({"error": "s.bin.rank1-of-2: no such file"},
                            "rank 1: s.bin.rank1-of-2: no such file"),
                           ({"error": None, "save": "another", "budget": 9},
                            f"{path}: rank 1's file is not from the same save as rank 0's "
                            "(save all ranks again)")):
        with pytest.raises(CacheError) as info:
            read_prompt_cache(path, model, rank0(other))
        assert str(info.value) == message
    one = saved(tmp_path / "one.bin", model)
    with pytest.raises(CacheError, match=r"^rank 0: .*one.bin: the cache was made by one "
                                         r"process; this is rank 0 of 2 \(pipeline 0-5, 6-11\)$"):
        read_prompt_cache(one, model, rank0({"error": "not checked"}))
