"""The three DSpark stages, block-isolated against the reference (tests/data/blocks/*/
dspark.safetensors: the reference's drafter at the golden's decode step 0, after its prefill).

The stage rings are seeded from the recorded `main_x` of the prompt, the step's `main_x` is
written, then every stage is fed its recorded input streams and `pre` at the block positions
after the rings'; outputs, rings, drafts, their logits and the confidence logits are compared.
Measured: rings, drafts and stages 1-2 bit-exact, tiny stage 0 one bf16 ulp at 0.04 % of its
elements; logits and confidence within 2e-6.
"""

import mlx.core as mx
import numpy as np
import pytest

import mlx_v41
from conftest import DATA, reference_ops
from test_blocks import MAX, P999, PRE_OUT, REL_RMS, Golden, stream_stats, teacher_inputs

pytestmark = pytest.mark.usefixtures("cpu")

CONFIGS = ["tiny", "schedule"]
LOGITS_ATOL = 1e-4  # fp32 GEMM order (measured 2e-6)


def _write(drafter, rings, main_x, position):
    """What a target forward does at its commit: ring rows from main_x, offsets advanced."""
    drafter.write_rings(rings, main_x, position)
    for ring in rings:
        ring.offset = ring.window.end


@pytest.fixture(scope="module")
def drafted():
    """name -> (recorded tensors, model, rings after the step, captured stage outputs, draft)."""
    done = {}

    def get(name: str):
        if name not in done:
            d = mx.load(str(DATA / "blocks" / name / "dspark.safetensors"))
            model = reference_ops(mlx_v41.load_model(DATA / "goldens" / name / "hf",
                                                     dspark=True))
            drafter = model.dspark
            rings = model.make_cache()[model.cfg.num_hidden_layers:]
            _write(drafter, rings, d["seed.main_x"][None], 0)
            start = int(d["step.start_pos"].item())
            seeded = [drafter.ring_keys(ring, start) for ring in rings]
            _write(drafter, rings, d["step.main_x"][None], start)
            stages = {k: (d[f"step.stage.{k}.in"][None], d[f"step.stage.{k}.pre_in"][None])
                      for k in range(len(drafter.stages))}
            captured = {}
            anchor = mx.array([int(d["step.input_id"].item())])
            draft = drafter.draft(model.model.embed_tokens, model.lm_head.weight, anchor, rings,
                                  stage_inputs=stages, capture=captured)
            mx.eval(draft, captured, seeded)
            done[name] = (d, model, seeded, rings, captured, draft)
        return done[name]

    return get


@pytest.mark.parametrize("name", CONFIGS)
def test_rings_hold_the_recorded_window(drafted, name):
    """FP8-rounded KV of `main_x`, slot = position mod window: exact after the prompt and after
    the step's write."""
    d, model, seeded, rings, _, _ = drafted(name)
    after = [model.dspark.ring_keys(ring, ring.offset) for ring in rings]
    for k in range(len(model.dspark.stages)):
        assert mx.array_equal(seeded[k][0], d[f"seed.stage.{k}.window_kv"]), (name, k)
        assert mx.array_equal(after[k][0], d[f"step.stage.{k}.window_kv"]), (name, k)


@pytest.mark.parametrize("name", CONFIGS)
def test_main_x_from_the_taps(drafted, name):
    """main_norm(main_proj(taps)) against the recorded main_x: at most one bf16 ulp."""
    d, model, *_ = drafted(name)
    ours = model.dspark.main_x([d["seed.main_hidden"][None]])[0]
    ulps = np.abs(np.array(ours.view(mx.int16)).astype(np.int32)
                  - np.array(d["seed.main_x"].view(mx.int16)).astype(np.int32))
    assert ulps.max() <= 1, f"{name}: main_x off by {ulps.max()} ulps"


@pytest.mark.parametrize("name", CONFIGS)
def test_stages(drafted, name):
    d, model, _, _, captured, _ = drafted(name)
    rows = np.ones(d["step.stage.0.out"].shape[0], bool)
    for k, (streams, pre) in captured.items():
        stats = stream_stats(streams[0], d[f"step.stage.{k}.out"], rows)
        stats["pre_out"] = mx.abs(pre[0] - d[f"step.stage.{k}.pre_out"]).max().item()
        message = f"{name} DSpark stage {k}: {stats}"
        assert stats["p99.9"] <= P999 and stats["max"] <= MAX, message
        assert stats["rel-rms"] <= REL_RMS and stats["pre_out"] <= PRE_OUT, message


@pytest.mark.parametrize("name", CONFIGS)
def test_drafts_logits_and_confidence(drafted, name):
    d, *_, draft = drafted(name)
    tokens, logits, confidence = draft
    assert np.array(tokens[0]).tolist() == np.array(d["step.output_ids"]).tolist()
    assert mx.abs(logits[0] - d["step.logits"]).max().item() <= LOGITS_ATOL
    assert mx.abs(confidence[0] - d["step.confidence"]).max().item() <= LOGITS_ATOL


@pytest.mark.parametrize("name", CONFIGS)
def test_taps_of_the_teacher_forced_prefill(drafted, name):
    """The backbone's taps (mean over the copies of the streams entering the target layers,
    before any Engram write) equal the reference's `main_hidden` in the teacher-forced prefill."""
    d, model, *_ = drafted(name)
    golden = Golden(name)
    layers = tuple(model.cfg.dspark_target_layer_ids)
    teacher = teacher_inputs(golden, model.cfg.candidate_block_size)
    teacher.streams = {L: teacher.streams[L] for L in layers}
    teacher.pre = {L: teacher.pre[L] for L in layers}
    out = model.forward(golden.ids[None], teacher=teacher, taps=layers)
    taps = mx.concatenate([out.taps[L] for L in layers], axis=-1)[0]
    assert mx.array_equal(taps, d["seed.main_hidden"]), name
