"""`prefill_mode="ced_replay"`, the tech report's bounded replay: the decoder runs over the last
window of rows only, with no window rows before them. Exact for prompts within one window,
APPROXIMATE beyond, by a measured amount.

The drift is the relative RMS difference of the last position's logits from a full prefill's,
over prompt lengths 20, 32, ..., 200 of the tiny golden prompt (window 16). Measured: median
0.038; single lengths reach 0.4, where the model's chaos amplifies the difference, so the bound
is on the median. A replay over fewer rows drifts more: 8 rows 0.077, 1 row (the window
dropped) 0.116. Runs on the CPU backend (the `cpu` fixture), where the full prefill's logits of
every prefix come out of one call exactly as from a call per prefix.
"""

import mlx.core as mx
import numpy as np
import pytest

import mlx_v41
from conftest import golden_checkpoint, reference_ops

pytestmark = pytest.mark.usefixtures("cpu")

LENGTHS = range(20, 201, 12)
MAX_MEDIAN_DRIFT = 0.06


@pytest.fixture(scope="module")
def replay():
    return reference_ops(mlx_v41.load_model(golden_checkpoint("tiny"), prefill_mode="ced_replay"))


@pytest.fixture(scope="module")
def prompt(goldens):
    return goldens("tiny").prompt[None].astype(mx.int32)


def relative_rms(a: mx.array, b: mx.array) -> float:
    return (mx.sqrt(mx.mean((a - b) ** 2)) / mx.sqrt(mx.mean(a * a))).item()


def test_replay_is_exact_within_one_window(replay, prompt):
    full = replay(prompt[:, :16])  # every position's logits: always a full forward
    for n in (1, 5, 15, 16):
        assert mx.array_equal(replay(prompt[:, :n], last_only=True)[:, -1], full[:, n - 1]), n


@pytest.mark.slow
def test_replay_drift_beyond_one_window(replay, prompt):
    full = replay(prompt[:, :max(LENGTHS)])  # every position's logits from one full forward
    assert mx.array_equal(full[:, 59], replay(prompt[:, :60])[:, -1])  # == a call per prefix
    drift = [relative_rms(full[0, n - 1], replay(prompt[:, :n], last_only=True)[0, -1])
             for n in LENGTHS]
    assert min(drift) > 0, drift  # approximate: every length beyond the window differs
    assert np.median(drift) <= MAX_MEDIAN_DRIFT, np.round(drift, 3)
