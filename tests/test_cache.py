"""The packed cache: 890 B/token at real widths, exact CED prefill, chunked prefill, trimming,
saving and loading (spec cache.md)."""

import mlx.core as mx
import numpy as np
import pytest

import mlx_v41
from mlx_v41 import CacheError, cache_bytes, trim_cache
from mlx_v41.model.schedule import ced_halo
from mlx_v41.model.config import ModelArgs, TextConfig
from mlx_v41.model.model import Model
from conftest import golden_checkpoint, packed_state, slow

# Exact equalities between different computations: they hold on the CPU backend.
pytestmark = pytest.mark.usefixtures("cpu")


@pytest.fixture(scope="module")
def prompt(goldens):
    return goldens("tiny").prompt[None].astype(mx.int32)


def _model(mode="ced", dspark=False):
    """The backbone's cache (the drafter's rings and its extra halo row: tests/test_dspark.py)."""
    return mlx_v41.load_model(golden_checkpoint("tiny"), prefill_mode=mode, dspark=dspark)


@pytest.mark.slow
def test_real_width_cache_is_890_bytes_per_token():
    """Real head_dim 512 / index_head_dim 128 and owner layers 2/8/14/20; small otherwise."""
    text = TextConfig(hidden_size=64, num_attention_heads=1, q_lora_rank=32, o_lora_rank=32,
                      o_groups=1, moe_intermediate_size=32, n_routed_experts=2,
                      num_experts_per_tok=1, index_n_heads=1, vocab_size=64,
                      engram_layer_ids=[], engram_num_embeddings=[], dspark_n_routed_experts=2,
                      dspark_num_experts_per_tok=1)
    model = Model(ModelArgs(text_config=text))
    cache = model.make_cache()
    for n in (63, 64):  # odd: the open ratio-2 groups are not committed rows yet
        ids = mx.zeros((1, n - cache[0].offset), dtype=mx.int32)
        model(ids, cache=cache, last_only=True)
        expected = 356 * n + 3 * 356 * (n // 2)
        assert cache_bytes(cache)["global_kv"] == expected
    assert cache_bytes(cache)["global_kv"] == 890 * 64
    assert cache_bytes(cache)["window"] == 40 * 256 * 528


# The longest prompts are slow; the fast lane keeps the lengths around the group and window
# boundaries.
@pytest.mark.parametrize("n,rollback", [(n, None) for n in (10, 61, 76, 77, 78, 92, 93)]
                         + [slow(150, None), slow(201, None)]
                         + [(n, 0) for n in (60, 61, 62, 76, 77)] + [slow(201, 0)])
def test_ced_prefill_equals_full_prefill(prompt, n, rollback):
    """tiny: decoder from layer 7, window 16: halo of 76 window rows / 61 computed rows at
    layer 7 (ced_rollback=0), 92 / 77 with the default rollback rows; lengths around and
    well above both."""
    full = _model("full")
    ced = mlx_v41.load_model(golden_checkpoint("tiny"), ced_rollback=rollback)
    cf, cc = full.make_cache(), ced.make_cache()
    a = full(prompt[:, :n], cache=cf, last_only=True)
    b = ced(prompt[:, :n], cache=cc, last_only=True)
    assert mx.array_equal(a, b)
    for x, y in zip(packed_state(cf), packed_state(cc)):
        assert mx.array_equal(x, y)
    for token in (5, 9):
        step = mx.array([[token]], dtype=mx.int32)
        assert mx.array_equal(full(step, cache=cf), ced(step, cache=cc))


@pytest.mark.slow
def test_ced_skips_decoder_rows(prompt):
    model = _model("ced")
    # The spec's halo, then the default one extended for a rollback of window + 1 = 17.
    assert ced_halo(model.cfg, 201) == [(76, 61), (61, 46), (46, 31), (31, 16), (16, 1)]
    assert model.ced_rollback == 17
    assert ced_halo(model.cfg, 201, 17) == [(92, 77), (77, 62), (62, 47), (47, 32), (32, 1)]
    captured = {}
    model(prompt, last_only=True, capture=captured)
    assert captured["layers.7.out"].shape[1] == 77
    assert captured["layers.11.out"].shape[1] == 1
    assert captured["layers.6.out"].shape[1] == 201
    minimal = mlx_v41.load_model(golden_checkpoint("tiny"), ced_rollback=0, dspark=False)
    minimal(prompt, last_only=True, capture=captured)
    assert captured["layers.7.out"].shape[1] == 61
    # The drafter (loaded by default from this folder) needs one more row for its rollback.
    mlx_v41.load_model(golden_checkpoint("tiny"))(prompt, last_only=True, capture=captured)
    assert captured["layers.7.out"].shape[1] == 78
    assert mx.array_equal(minimal(prompt, last_only=True), model(prompt, last_only=True))


@pytest.mark.parametrize("step,length", [(1, 30), (7, 201), slow(37, 201), slow(64, 201)])
@pytest.mark.slow
def test_chunked_prefill_equals_one_chunk(prompt, step, length):
    model = _model("ced")
    ids = prompt[:, :length]
    reference = model(ids, last_only=True)
    cache = model.make_cache()
    assert mx.array_equal(model.prefill(ids, cache, step_size=step), reference)
    assert cache[0].offset == length


def test_continuation_prefill(prompt):
    model = _model("ced")
    cache = model.make_cache()
    model.prefill(prompt[:, :120], cache)
    assert mx.array_equal(model.prefill(prompt[:, 120:], cache, step_size=33),
                          model(prompt, last_only=True))


@pytest.mark.parametrize("mode,n", [("full", 17), ("ced", 16), ("ced", 3)])
@pytest.mark.slow
def test_trim_then_redo(prompt, mode, n):
    """Trim back over decoded rows (to odd and even lengths: the open ratio-2 group is
    reopened from the compressor-input ring) and redo: identical logits. 17 = the most a
    16-token window with a 32-slot ring can undo."""
    model = _model(mode)
    cache = model.make_cache()
    model.prefill(prompt[:, :80], cache)
    first = [model(prompt[:, 80 + i:81 + i], cache=cache) for i in range(20)]
    trim_cache(cache, n)
    assert cache[0].offset == 100 - n
    again = [model(prompt[:, 100 - n + i:101 - n + i], cache=cache) for i in range(n)]
    for a, b in zip(first[20 - n:], again):
        assert mx.array_equal(a, b)


@pytest.mark.parametrize("rollback,n", [(17, 17), (17, 8), (5, 5), (0, 1)])
@pytest.mark.slow
def test_trim_right_after_ced_prefill(prompt, rollback, n):
    """The CED halo is extended so the decoder rings hold what a trim of `ced_rollback`
    tokens needs: trimming then continuing equals a full prefill of the shorter prompt."""
    model = mlx_v41.load_model(golden_checkpoint("tiny"), ced_rollback=rollback)
    full = _model("full")
    cache = model.make_cache()
    model.prefill(prompt[:, :150], cache, step_size=64)
    assert min(c.max_trim() for c in cache) == max(rollback, 1)
    trim_cache(cache, n)
    reference = full.make_cache()
    full.prefill(prompt[:, :150 - n], reference)
    for x, y in zip(packed_state(reference), packed_state(cache)):
        assert mx.array_equal(x, y)
    step = prompt[:, 150 - n:160 - n]
    assert mx.array_equal(model(step, cache=cache), full(step, cache=reference))


def test_ced_rollback_must_fit_the_ring():
    with pytest.raises(ValueError, match=r"ced_rollback must be an int in \[0, 17\]"):
        mlx_v41.load_model(golden_checkpoint("tiny"), ced_rollback=18)


def test_trim_too_far_is_refused_and_changes_nothing(prompt):
    model = mlx_v41.load_model(golden_checkpoint("tiny"), ced_rollback=3)
    cache = model.make_cache()
    model.prefill(prompt[:, :100], cache)
    before = packed_state(cache)
    with pytest.raises(CacheError, match="at most 3"):
        trim_cache(cache, 5)      # the CED prefill kept 3 tokens of rollback in layer 11
    with pytest.raises(CacheError, match="holds 100"):
        trim_cache(cache, 101)
    assert cache[0].offset == 100
    assert all(mx.array_equal(x, y) for x, y in zip(before, packed_state(cache)))


def test_mlx_lm_trim_helpers_work(prompt):
    from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache
    model = _model("full")
    cache = model.make_cache()
    model.prefill(prompt[:, :40], cache)
    assert can_trim_prompt_cache(cache)
    assert trim_prompt_cache(cache, 4) == 4 and cache[0].offset == 36


def test_save_load_roundtrip(tmp_path, prompt):
    model = _model("ced")
    cache = model.make_cache()
    model.prefill(prompt[:, :121], cache)    # odd: an open ratio-2 group is saved
    path = tmp_path / "prompt.safetensors"
    mlx_v41.save_prompt_cache(path, cache, model, {"turns": "1"})
    loaded, meta = mlx_v41.load_prompt_cache(path, model, return_metadata=True)
    assert meta == {"turns": "1"}
    for token in (5, 9, 11):
        step = mx.array([[token]], dtype=mx.int32)
        assert mx.array_equal(model(step, cache=cache), model(step, cache=loaded))
    assert not list(tmp_path.glob(".*tmp*"))


def test_load_refuses_other_config_and_corrupt_files(tmp_path, prompt):
    model = _model("ced")
    cache = model.make_cache()
    model.prefill(prompt[:, :20], cache)
    path = tmp_path / "prompt.safetensors"
    mlx_v41.save_prompt_cache(path, cache, model)
    other = mlx_v41.load_model(golden_checkpoint("schedule"))
    with pytest.raises(CacheError, match="another config"):
        mlx_v41.load_prompt_cache(path, other)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CacheError, match="not a readable"):
        mlx_v41.load_prompt_cache(path, model)


def test_copy_cache_is_an_independent_snapshot(prompt):
    model = _model("full")
    cache = model.make_cache()
    model.prefill(prompt[:, :50], cache)
    snapshot = mlx_v41.copy_cache(cache)
    model(prompt[:, 50:60], cache=cache)
    assert snapshot[0].offset == 50
    step = prompt[:, 50:60]
    fresh = model.make_cache()
    model.prefill(prompt[:, :50], fresh)
    assert mx.array_equal(model(step, cache=snapshot), model(step, cache=fresh))


def test_rows_shared_by_a_batch_read_as_their_own_and_copy_out():
    """`cache/stacked.py`: rings (and a subclass's inherited fields, as a pipeline rank's
    mirrored rows) that are rows of one shared array read as their own rows; the array is
    reused only for the same holders in the same order; a layer snapshot restores the sharing;
    `unshare_cache` gives each its own copy (the compressed rows cut to their pages)."""
    from mlx_v41.cache.layer import GROW_STEP, CompressedKV, LayerCache, unshare_cache
    from mlx_v41.cache.stacked import is_shared, share, stacked

    class Mirror(CompressedKV):
        pass

    caches = [LayerCache(4, ratio=2, owns_kv=True) for _ in range(3)]
    for i, c in enumerate(caches):
        c.compressed = Mirror(2, 8)
        c.window.rows = mx.full((1, 8, 5), i, mx.uint8)
        c.compressed.inputs = mx.full((1, 8, 2, 3), float(i))
        c.compressed.kv = mx.full((1, 2 * GROW_STEP, 4), i, mx.uint8)
        c.compressed.index_k = mx.full((1, 2 * GROW_STEP, 2), i, mx.uint8)
        c.compressed.count = 3
    rings = [c.window for c in caches]
    joined = stacked(rings, "rows")
    assert joined.shape == (3, 8, 5) and not is_shared(rings[0], "rows")
    share(rings, "rows", joined + 10)
    saved = caches[1].snapshot()
    assert stacked(rings, "rows") is stacked(rings, "rows")  # the shared array itself
    assert stacked(rings[::-1], "rows") is not stacked(rings, "rows")
    assert [int(r.rows[0, 0, 0]) for r in rings] == [10, 11, 12]
    assert [int(r.rows[0, 0, 0]) for r in rings[::-1]] == \
        [int(v) for v in stacked(rings[::-1], "rows")[:, 0, 0]]
    rings[1].rows = mx.zeros((1, 8, 5), mx.uint8)  # a write alone: its own array again
    assert not is_shared(rings[1], "rows") and is_shared(rings[0], "rows")
    caches[1].restore(saved)
    assert is_shared(rings[1], "rows") and int(rings[1].rows[0, 0, 0]) == 11
    stores = [c.compressed for c in caches]
    share(stores, "inputs", stacked(stores, "inputs"))
    share(stores, "kv", stacked(stores, "kv"))
    unshare_cache([caches[2]])
    mine = caches[2]
    assert not any(is_shared(x, n) for x, n in ((mine.window, "rows"),
                                                (mine.compressed, "inputs"),
                                                (mine.compressed, "kv")))
    assert mine.window.rows.shape == (1, 8, 5) and int(mine.window.rows[0, 0, 0]) == 12
    assert float(mine.compressed.inputs[0, 0, 0, 0]) == 2.0
    assert mine.compressed.kv.shape == (1, GROW_STEP, 4)  # its 3 rows' page, not the pool's
    assert int(mine.compressed.kv[0, 0, 0]) == 2
    assert is_shared(caches[0].compressed, "kv")


@pytest.mark.parametrize("open_group", ["view", "ring slot"])
def test_a_cache_that_leaves_a_batch_keeps_none_of_its_arrays_alive(open_group):
    """After `unshare_cache` nothing of the cache views the batch's arrays, its open compressor
    group included (a slice of the batch's rows, or the slot of the input ring that a batch
    step or a rollback leaves): the batch's memory goes once the batch drops it."""
    from mlx_v41.cache.layer import LayerCache, unshare_cache
    from mlx_v41.cache.stacked import share

    caches = [LayerCache(4, ratio=2, owns_kv=True) for _ in range(4)]
    big = mx.ones((4, 4096, 2, 256))  # 32 MiB of input rings, shared by the four
    mx.eval(big)
    share([c.compressed for c in caches], "inputs", big)
    mine = caches[1].compressed
    if open_group == "view":
        mine.pending = (mine.inputs[:, 7:8, 0], mine.inputs[:, 7:8, 1])
    else:
        mine.open_at(7)
    left = caches[1]
    unshare_cache([left])
    mx.eval(left.state)
    before = mx.get_active_memory()
    del big, caches  # the batch goes; the cache that left stays
    assert before - mx.get_active_memory() >= 30 * 2 ** 20
    assert float(mine.pending[0][0, 0, 0]) == 1.0 and mine.pending[1].shape == (1, 1, 256)


def test_positions_past_the_maximum_are_refused(prompt):
    model = _model("ced")
    cache = model.make_cache()
    model.prefill(prompt[:, :10], cache)
    model.cfg.max_position_embeddings = 12
    try:
        with pytest.raises(ValueError, match="max_position_embeddings"):
            model(prompt[:, 10:13], cache=cache)
        assert cache[0].offset == 10
    finally:
        model.cfg.max_position_embeddings = 1048576


def test_rope_at_the_last_position_is_computed_not_tabulated():
    from mlx_v41.numerics.rope import RoPE
    rope = RoPE(64, 160000.0, {"rope_type": "yarn", "factor": 16, "beta_fast": 32,
                               "beta_slow": 1, "original_max_position_embeddings": 65536})
    x = mx.ones((1, 1, 64))
    out = np.array(rope(x, mx.array([1048575]))[0, 0])
    theta = np.float32(1048575) * np.array(rope.freqs)
    expected = np.stack([np.cos(theta) - np.sin(theta), np.sin(theta) + np.cos(theta)], -1)
    assert np.allclose(out, expected.reshape(-1), atol=1e-5)
