"""Engram hashing: spec constants and vectors, golden token maps and row ids, streaming history."""

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from mlx_v41.model.engram_hash import (DEAD, EngramHasher, build_token_map, engram_multipliers,
                                       engram_offsets, engram_primes, load_token_map, ngram_hashes,
                                       padded_lookback)

DATA = Path(__file__).parent / "data" / "engram"
VECTORS = json.loads((DATA / "engram_vectors.json").read_text())
CONSTANTS = VECTORS["constants"]
GOLDEN_CONFIGS = json.loads((DATA / "golden_configs.json").read_text())
GOLDEN_NAMES = sorted(GOLDEN_CONFIGS)
TOKENIZER = DATA / "tokenizer.json"
RELEASE_LAYERS = ("layer_1", "layer_14")


def release_hasher(**overrides) -> EngramHasher:
    """The released configuration with an identity token map (the vectors are compressed ids)."""
    c = CONSTANTS
    args = dict(
        layer_ids=c["engram_layer_ids"],
        max_ngram_size=c["max_ngram_size"],
        n_heads=c["n_heads"],
        vocab_size=c["engram_vocab_size"],
        compressed_vocab_size=c["compressed_vocab_size"],
        pad_token_id=c["pad_token_id"],
        num_embeddings=[c["row_counts"][k] for k in RELEASE_LAYERS],
        token_map=np.arange(c["compressed_vocab_size"]),
    )
    return EngramHasher(**(args | overrides))


@pytest.fixture(scope="module")
def golden_token_map():
    return build_token_map(TOKENIZER, compressed_vocab_size=308)


@pytest.fixture(scope="module")
def goldens():
    with np.load(DATA / "goldens.npz") as f:
        return dict(f)


def golden_hasher(name, token_map) -> EngramHasher:
    config = SimpleNamespace(**GOLDEN_CONFIGS[name]["text_config"])
    return EngramHasher.from_config(config, token_map)


# --- constants (engram.md §3) -----------------------------------------------------------------


def test_release_constants():
    c = CONSTANTS
    layers, ngram = c["engram_layer_ids"], c["max_ngram_size"]
    primes = engram_primes(layers, ngram, c["n_heads"], c["engram_vocab_size"])
    assert primes.dtype == np.int64 and primes.shape == (2, 3, 8)
    offsets = engram_offsets(primes)
    multipliers = engram_multipliers(layers, ngram, c["compressed_vocab_size"])
    for i, key in enumerate(RELEASE_LAYERS):
        assert primes[i].tolist() == c["primes"][key]
        assert offsets[i].tolist() == c["offsets"][key]
        assert multipliers[i].tolist() == c["multipliers"][key]
        assert int(primes[i].sum()) == c["row_counts"][key]
    assert ((2**63 - 1) // c["compressed_vocab_size"]) // 2 == c["multiplier_bound_exclusive"]
    assert (multipliers < 2 * c["multiplier_bound_exclusive"]).all()
    assert (multipliers % 2 == 1).all()
    hasher = release_hasher()
    assert hasher.pad_id == c["pad_compressed_id"] and hasher.n_columns == 24


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_golden_primes(name):
    cfg = GOLDEN_CONFIGS[name]["text_config"]
    keys = ("engram_layer_ids", "engram_max_ngram_size", "engram_n_heads", "engram_vocab_size")
    primes = engram_primes(*(cfg[k] for k in keys))
    assert primes.tolist() == GOLDEN_CONFIGS[name]["engram_primes"]


# --- spec vectors (engram.md §4, §9) ----------------------------------------------------------


@pytest.mark.parametrize("case", VECTORS["cases"], ids=lambda c: c["name"])
def test_vector_cases(case):
    hasher = release_hasher()
    compressed = np.array([case["compressed_ids"]], dtype=np.int64)
    row_ids, history = hasher.hash_compressed(compressed)
    assert row_ids.dtype == np.int64 and row_ids.shape == (1, compressed.shape[1], 2, 24)
    np.testing.assert_array_equal(row_ids[0], np.array(case["hash_ids"]))
    # The raw-id entry with a dead mask is the same computation; masked ids are never looked up.
    row_ids_raw, history_raw = hasher.hash(compressed, dead=compressed == DEAD)
    np.testing.assert_array_equal(row_ids_raw, row_ids)
    np.testing.assert_array_equal(history_raw, history)


def test_vector_intermediates():
    hasher = release_hasher()
    example = VECTORS["intermediates_example"]
    compressed = np.array([example["compressed_ids"]], dtype=np.int64)
    lookback = padded_lookback(compressed, hasher.fresh_history(1), hasher.pad_id)
    rolling = ngram_hashes(lookback, hasher.multipliers)
    row_ids, _ = hasher.hash_compressed(compressed)
    for pos in example["positions"]:
        t = pos["position"]
        assert lookback[0, t].tolist() == pos["padded_lookback_tokens_t_t-1_t-2_t-3"]
        for layer, expected in enumerate(pos["per_engram_layer"]):
            assert (lookback[0, t] * hasher.multipliers[layer]).tolist() == expected["products"]
            assert rolling[0, t, layer].tolist() == expected["rolling_xor_2_3_4gram"]
            assert row_ids[0, t, layer].tolist() == expected["hash_ids"]


# --- token map (engram.md §2) -----------------------------------------------------------------


def test_golden_token_map(golden_token_map):
    expected = json.loads((DATA / "engram_token_map.json").read_text())
    assert golden_token_map.dtype == np.int32
    assert golden_token_map.tolist() == expected


def test_token_map_normalisation(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    words = [" ", "  ", "\t \n", "A", "a", "\u00c1", "\u0301"]
    words += ["\ufffd", "Ab\ufffd", "ab\ufffd", "\uff21b"]
    tokenizer = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token=" "))
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    # Whitespace runs -> " " (kept by the sentinel); case and accents fold; an accent alone
    # normalises to "" and keys on itself; U+FFFD tokens key on the raw token string (no folding);
    # NFKC folds the fullwidth letter.
    expected = [0, 0, 0, 1, 1, 1, 2, 3, 4, 5, 6]
    assert build_token_map(path).tolist() == expected
    with pytest.raises(ValueError, match="engram_compressed_vocab_size"):
        build_token_map(path, compressed_vocab_size=6)


def test_token_map_wrong_size_names_key_and_file():
    with pytest.raises(ValueError) as err:
        build_token_map(TOKENIZER, compressed_vocab_size=307)
    assert "engram_compressed_vocab_size" in str(err.value)
    assert "tokenizer.json" in str(err.value)


def test_load_token_map_caches_by_digest(tmp_path, golden_token_map):
    first = load_token_map(TOKENIZER, cache_dir=tmp_path, compressed_vocab_size=308)
    (cached,) = tmp_path.glob("engram_token_map-*.npy")
    np.testing.assert_array_equal(np.load(cached), golden_token_map)
    np.testing.assert_array_equal(load_token_map(TOKENIZER, cache_dir=tmp_path), first)


# --- goldens from the official reference ------------------------------------------------------


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_golden_prefill(name, golden_token_map, goldens):
    hasher = golden_hasher(name, golden_token_map)
    prompt = goldens[f"{name}.prompt_ids"]
    compressed = goldens[f"{name}.prefill_compressed"]
    np.testing.assert_array_equal(hasher.compress(prompt), compressed)
    row_ids, history = hasher.hash(prompt[None])
    np.testing.assert_array_equal(row_ids[0], goldens[f"{name}.prefill_hash"])
    np.testing.assert_array_equal(history[0], compressed[-3:])


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_golden_decode_carries_history(name, golden_token_map, goldens):
    hasher = golden_hasher(name, golden_token_map)
    _, history = hasher.hash(goldens[f"{name}.prompt_ids"][None])
    steps = []
    for token in goldens[f"{name}.decode_ids"]:
        row_ids, history = hasher.hash(np.array([[token]]), history)
        steps.append(row_ids[0, 0])
    np.testing.assert_array_equal(np.stack(steps), goldens[f"{name}.decode_hash"])


def test_from_config_accepts_mapping(golden_token_map):
    cfg = GOLDEN_CONFIGS["schedule"]["text_config"]
    a = EngramHasher.from_config(cfg, golden_token_map)
    b = golden_hasher("schedule", golden_token_map)
    np.testing.assert_array_equal(a.multipliers, b.multipliers)
    assert a.layer_ids == [1, 14]


# --- streaming -------------------------------------------------------------------------------


def random_compressed(rng, batch, length, vocab):
    ids = rng.integers(0, vocab, size=(batch, length))
    ids[:, 0] = 0  # BOS compresses to 0: a zero product
    for b in range(batch):  # a few image spans, some of length 1
        for _ in range(3):
            start = rng.integers(0, length)
            ids[b, start : start + rng.integers(1, 6)] = DEAD
    return ids


@pytest.mark.parametrize("which", ["release", "tiny"])
def test_streaming_equals_one_shot(which, golden_token_map):
    hasher = release_hasher() if which == "release" else golden_hasher("tiny", golden_token_map)
    rng = np.random.default_rng(7)
    compressed = random_compressed(rng, 3, 97, hasher.compressed_vocab_size)
    full, full_history = hasher.hash_compressed(compressed)
    for _ in range(20):
        cuts = np.sort(rng.choice(np.arange(1, 97), size=rng.integers(1, 6), replace=False))
        history, parts = None, []
        for chunk in np.split(compressed, cuts, axis=1):
            row_ids, history = hasher.hash_compressed(chunk, history)
            parts.append(row_ids)
        np.testing.assert_array_equal(np.concatenate(parts, axis=1), full)
        np.testing.assert_array_equal(history, full_history)


def test_empty_chunk_keeps_history():
    hasher = release_hasher()
    history = np.array([[5, DEAD, 9]])
    row_ids, new_history = hasher.hash_compressed(np.zeros((1, 0), dtype=np.int64), history)
    assert row_ids.shape == (1, 0, 2, 24)
    np.testing.assert_array_equal(new_history, history)


def test_batch_rows_are_independent():
    hasher = release_hasher()
    compressed = random_compressed(np.random.default_rng(3), 2, 40, hasher.compressed_vocab_size)
    both, _ = hasher.hash_compressed(compressed)
    for b in range(2):
        one, _ = hasher.hash_compressed(compressed[b : b + 1])
        np.testing.assert_array_equal(both[b : b + 1], one)


def test_2k_prompt_rows_stay_in_their_tables():
    """A 2048-token prompt in one call equals it in chunks of 256 (the history carried), and
    every row id falls in its own head's table (speed is measured by the benchmarks)."""
    hasher = release_hasher()
    ids = np.random.default_rng(0).integers(0, hasher.compressed_vocab_size, size=(2, 2048))
    row_ids, history = hasher.hash(ids)
    assert row_ids.shape == (2, 2048, 2, 24)
    offsets = hasher.offsets[None, None]
    assert ((row_ids >= offsets) & (row_ids < offsets + hasher.primes.reshape(2, 24))).all()
    carried, parts = None, []
    for chunk in np.split(ids, range(256, 2048, 256), axis=1):
        part, carried = hasher.hash(chunk, carried)
        parts.append(part)
    np.testing.assert_array_equal(np.concatenate(parts, axis=1), row_ids)
    np.testing.assert_array_equal(carried, history)


# --- errors ----------------------------------------------------------------------------------


def test_wrong_num_embeddings():
    with pytest.raises(ValueError, match="engram_num_embeddings"):
        release_hasher(num_embeddings=[384006168, 384016683])


def test_token_map_size_must_match_compressed_vocab(golden_token_map):
    cfg = dict(GOLDEN_CONFIGS["tiny"]["text_config"], engram_compressed_vocab_size=309)
    with pytest.raises(ValueError, match="engram_compressed_vocab_size"):
        EngramHasher.from_config(cfg, golden_token_map)


def test_bad_inputs():
    hasher = release_hasher()
    with pytest.raises(ValueError, match="history"):
        hasher.hash(np.zeros((2, 4), dtype=np.int64), history=hasher.fresh_history(1))
    with pytest.raises(ValueError, match="token ids"):
        hasher.hash(np.array([[hasher.compressed_vocab_size]]))
    with pytest.raises(ValueError, match=r"\[B, S\]"):
        hasher.hash(np.zeros(4, dtype=np.int64))
