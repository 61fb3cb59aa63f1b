"""The lazy (MLX ops) Engram hashing the model runs equals the host hasher that the reference's
test vectors check, with DEAD positions, short and missing histories."""

import mlx.core as mx
import numpy as np
import pytest


# Exact equalities between different computations: they hold on the CPU backend.
pytestmark = pytest.mark.usefixtures("cpu")


@pytest.fixture(scope="module")
def hasher(tiny_model):
    return tiny_model().engram_hasher


@pytest.mark.parametrize("history", [None, [], [7], [3, 9, 11], [-1, 5, 6]])
def test_lazy_hash_equals_the_host_hash(hasher, history):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, hasher.token_map.shape[0], size=(2, 23))
    compressed = hasher.compress(ids)
    if history is None:
        host_history, lazy_history = None, np.zeros((2, 0), np.int32)
    else:
        lazy_history = np.array([history] * 2, np.int32).reshape(2, -1)
        host_history = np.full((2, hasher.history_length), -1, np.int64)
        if lazy_history.shape[1]:
            host_history[:, -lazy_history.shape[1]:] = lazy_history
    expected, _ = hasher.hash_compressed(compressed, host_history)
    rows, lazy_compressed = hasher.hash_lazy(mx.array(ids), mx.array(lazy_history))
    assert np.array_equal(np.array(lazy_compressed), compressed)
    assert np.array_equal(np.array(rows), expected)


def test_lazy_hash_stops_at_dead_history(hasher):
    """A DEAD id (image span) in the history blocks the walk back, as on the host."""
    ids = np.array([[4, 5, 6, 7]])
    history = np.array([[8, -1, 9]])
    expected, _ = hasher.hash_compressed(hasher.compress(ids), history)
    rows, _ = hasher.hash_lazy(mx.array(ids), mx.array(history.astype(np.int32)))
    assert np.array_equal(np.array(rows), expected)
