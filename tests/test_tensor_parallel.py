"""Tensor parallel: the shares each rank loads (published and converted folders, in process),
the divisibility checks, and real 2-process runs under `mlx.launch` (ring over localhost).

At the tiny widths every reduced sum splits into whole 32-element groups, one or two per rank,
and MLX's CPU quantized matmul adds its groups' fp32 sums in order, so two ranks' halves add
to the same bits: the tiny checkpoint (the `grow` golden's) is bit-identical to one process.
A wider checkpoint (o_lora_rank 128, moe_intermediate_size 256: 4-8 groups per rank) sums in
another order: an fp32 ulp that flips a bf16 rounding is amplified by the FP8/FP4 rounding and
top-k downstream (tests/test_golden.py), so its logits are compared by statistics with margins
over the measured values (max |dlogit| 0.147 at 15 of 60 prompt rows, mean 0.0022, every
argmax equal; the last-row, chunked and decode logits were bit-identical).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from checkpoint_factory import write_checkpoint
from conftest import golden_checkpoint
from distributed_worker import grow_greedy
from mlx_v41.checkpoint.load import load_model
from mlx_v41.checkpoint.random_checkpoint import tiny_text_config
from mlx_v41.cli.generate import main as generate_main
from mlx_v41.convert import convert
from mlx_v41.distributed.tensor import ShardError, TensorParallelPlacement, check_shardable
from test_distributed import launch, reference

WIDE = dict(o_lora_rank=128, moe_intermediate_size=256)
WIDE_MAX, WIDE_MEAN, WIDE_ARGMAX = 0.5, 0.02, 0.95  # measured 0.147, 0.0022, 1.0


def fake_link(rank: int, size: int):
    """What a model needs of its link while it loads (no collective runs)."""
    return SimpleNamespace(rank=rank, size=size)


def rank_group(link, is_pipeline: bool):
    """A 2-rank group's `RankGroup` around a stand-in link."""
    from mlx_v41.distributed.group import RankGroup

    return RankGroup(link, "test split", is_pipeline)


def load_share(folder, rank: int, size: int = 2, dspark: bool = False):
    link = fake_link(rank, size)
    return load_model(folder, dspark=dspark, vision=False,
                      placement=TensorParallelPlacement(link))


def expected_share(name: str, value: mx.array, rank: int, size: int) -> mx.array:
    """One rank's part of a whole-model parameter, in MLX's layout: query rows, sinks,
    output groups and whole experts split along their first axis; `o_b_proj` and the shared
    expert's `down_proj` along their input words (and scales); the shared expert's gate and
    up along their output rows."""
    def part(x, axis):
        n = x.shape[axis] // size
        index = [slice(None)] * x.ndim
        index[axis] = slice(rank * n, (rank + 1) * n)
        return x[tuple(index)]

    if any(k in name for k in ("self_attn.q_b_proj", "self_attn.sinks", "o_a_proj", "switch_mlp")):
        return part(value, -2 if "q_b_proj" in name else 0)
    if "o_b_proj" in name or "shared_experts.down_proj" in name:
        return part(value, -1)
    if "shared_experts" in name:
        return part(value, -2)
    return value


def test_each_rank_loads_its_share_from_published_and_converted_folders(tmp_path):
    source = golden_checkpoint("tiny")
    converted = convert(source, tmp_path / "mlx", drop_dspark=True, drop_vision=True,
                        progress=False, log=lambda line: None)
    whole = dict(tree_flatten(load_model(source, dspark=False, vision=False).parameters()))
    split = 0
    whole_bytes = sum(v.nbytes for v in whole.values())
    for rank in range(2):
        for folder in (source, converted):
            mx.clear_cache()
            mx.reset_peak_memory()
            before = mx.get_active_memory()
            got = dict(tree_flatten(load_share(folder, rank).parameters()))
            share = sum(v.nbytes for v in got.values())
            if folder == source:  # only the share is ever read: measured share + 76 KB
                peak = mx.get_peak_memory() - before
                assert peak < share + 0.2 * (whole_bytes - share), (peak, share, whole_bytes)
            assert set(got) == set(whole)
            for name, value in got.items():
                want = expected_share(name, whole[name], rank, 2)
                assert value.shape == want.shape and mx.array_equal(value, want).item(), \
                    (folder, rank, name)
                split += value.shape != whole[name].shape
    # 4 loads x 12 layers x (q_b, o_a, o_b, 3 experts, 3 shared: weight + scales; sinks)
    assert split == 4 * 12 * 19


def test_the_drafter_splits_like_the_backbone():
    """With the drafter, each rank holds its share of every stage's query rows, sinks, output
    groups, experts and shared-expert width (the backbone's split); main_proj, the norms and
    the Markov and confidence heads whole."""
    whole = dict(tree_flatten(load_model(golden_checkpoint("tiny"), dspark=True,
                                         vision=False).parameters()))
    for rank in range(2):
        got = dict(tree_flatten(load_share(golden_checkpoint("tiny"), rank, dspark=True)
                                .parameters()))
        assert set(got) == set(whole)
        split = 0
        for name in (n for n in got if n.startswith("dspark.")):
            want = expected_share(name, whole[name], rank, 2)
            assert got[name].shape == want.shape and mx.array_equal(got[name], want).item(), \
                (rank, name)
            split += want.shape != whole[name].shape
        assert split == 3 * 19  # 3 stages x the backbone layer's 19 split tensors


TINY = dict(num_attention_heads=4, o_groups=2, n_routed_experts=8, moe_intermediate_size=64,
            dspark_n_routed_experts=8)


@pytest.mark.parametrize("field,value,size,message", [
    ("o_groups", 2, 4, "o_groups = 2 does not split over 4 ranks"),
    ("n_routed_experts", 6, 4, "n_routed_experts = 6 does not split over 4 ranks"),
    ("dspark_n_routed_experts", 6, 4, "dspark_n_routed_experts = 6 does not split over 4"),
    ("moe_intermediate_size", 96, 2, "moe_intermediate_size = 96 does not split over 2 ranks "
                                     "in whole 32-wide FP8 blocks")])
def test_an_axis_that_does_not_split_is_one_line(field, value, size, message):
    cfg = SimpleNamespace(**{**TINY, "o_groups": 4, field: value})
    with pytest.raises(ShardError, match=message):
        check_shardable(cfg, size, drafter=True)


def test_heads_over_three_ranks_is_one_line():
    with pytest.raises(ShardError, match="^--tensor-parallel: num_attention_heads = 4 does "
                                         "not split over 3 ranks"):
        load_share(golden_checkpoint("tiny"), 0, 3)


def _wide_checkpoint(folder: Path) -> Path:
    hf = write_checkpoint(folder / "hf", tiny_text_config(**WIDE), seed=7)
    shutil.copytree(golden_checkpoint("tiny").parent / "prefill", folder / "prefill")
    return hf


@pytest.mark.slow
def test_two_ranks_exact_on_tiny_close_on_wide_and_memory(tmp_path):
    """One launch: the tiny checkpoint's logits (CED, full, chunked prefill, decode) and the
    `grow` greedy tokens bit-identical to one process; the wide checkpoint's logits within
    the WIDE_* bounds; every rank the same logits; each rank's weights its share."""
    wide = _wide_checkpoint(tmp_path / "wide")
    tiny = golden_checkpoint("tiny")
    result = launch(2, "tests/distributed_worker.py", tiny, "tensor", tmp_path / "out",
                    "--wide", wide, timeout=240)
    assert (tmp_path / "out" / "logits.npz").is_file(), result.stdout + result.stderr
    reports = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in range(2)]
    got = np.load(tmp_path / "out" / "logits.npz")
    expected = reference(tiny)
    model = load_model(tiny, dspark=False, vision=False)
    expected["grow"] = grow_greedy(model)
    for name, value in expected.items():
        assert np.array_equal(got[name], value), (name, np.abs(got[name] - value).max())
    for name, value in reference(wide).items():
        err = np.abs(got[f"wide.{name}"] - value)
        agree = (got[f"wide.{name}"].argmax(-1) == value.argmax(-1)).mean()
        assert err.max() <= WIDE_MAX and err.mean() <= WIDE_MEAN, (name, err.max(), err.mean())
        assert agree >= WIDE_ARGMAX, (name, agree)
    assert reports[0]["digest"] == reports[1]["digest"]  # every rank computed the same logits

    whole = dict(tree_flatten(model.parameters()))
    split = sum(v.nbytes for k, v in whole.items() if expected_share(k, v, 0, 2) is not v)
    share = sum(v.nbytes for v in whole.values()) - split // 2
    for r in reports:
        assert r["params"] == share, (r["params"], share)
        assert r["active"] < 1.2 * r["params"] + 2 ** 20, r  # measured 1.02
    # Per decode token each layer reduces one attention row and [routed, shared] rows, fp32.
    cfg = model.cfg
    assert reports[0]["sent"]["decode"] == [0, cfg.num_hidden_layers * 3 * cfg.hidden_size * 4]


@pytest.mark.slow
def test_generate_cli_tensor_parallel_matches_one_process(tmp_path, capsys):
    """`mlx.launch -n 2 -- -m mlx_v41.generate --tensor-parallel`: rank 0 alone prints the
    one-process text (temperature 0.8, seed 3)."""
    args = ["--model", golden_checkpoint("tiny"), "-p", "hello", "-m", "10", "--temp", "0.8",
            "--seed", "3"]
    result = launch(2, "-m", "mlx_v41.generate", *args, "--tensor-parallel")
    assert generate_main([str(a) for a in args]) == 0
    one = capsys.readouterr().out.split("=" * 10)[1]
    assert result.stdout.count("=" * 10) == 2, result.stdout + result.stderr
    assert result.stdout.split("=" * 10)[1] == one
    assert generate_main([str(a) for a in args] + ["--tensor-parallel", "--pipeline"]) == 1
    assert "do not combine" in capsys.readouterr().err


def test_converted_shares_that_do_not_fit_the_packing_are_one_line():
    """A requantized folder (affine, other group sizes or bits): a share must hold whole
    scale groups and whole uint32 words."""
    from mlx_v41.checkpoint import slicing
    from mlx_v41.errors import CheckpointError

    share = slicing.Shard("in", 576, 1152, 1152)  # the shared expert's down_proj, rank 1 of 2
    four_bit = SimpleNamespace(bits=4, group_size=64)
    assert slicing.converted(share, "weight", four_bit, "w") == (Ellipsis, slice(72, 144))
    assert slicing.converted(share, "scales", four_bit, "w") == (Ellipsis, slice(9, 18))
    with pytest.raises(CheckpointError, match="tensor w: the share 576:1152 does not fall on "
                                              "its 128-element scale blocks"):
        slicing.converted(share, "scales", SimpleNamespace(bits=4, group_size=128), "w")
    with pytest.raises(CheckpointError, match="tensor w: 6-bit words do not split"):
        slicing.converted(share, "weight", SimpleNamespace(bits=6, group_size=64), "w")


@pytest.mark.slow
def test_image_prompt_under_tensor_parallel_equals_one_process(tmp_path, capsys):
    """The vision golden's checkpoint (tiny's text weights: whole 32-groups per rank) over 2
    ranks: the tower on rank 0 alone, which shares the expanded ids, token types and span
    records, and each call's span rows. Rank 1's logits of an image prompt (full prefill,
    chunked CED prefill with chunk boundaries inside the spans, decode steps) equal one
    process's bit for bit, and `generate --tensor-parallel --image` prints the one-process
    text."""
    from distributed_worker import generate_args, image_scenario
    from vision_fixtures import SMALL_MIN_PIXELS, TWIN_SPAN, twin_images, vision_checkpoint

    folder = vision_checkpoint(tmp_path / "hf", SMALL_MIN_PIXELS)
    images = twin_images(tmp_path)  # the prompt has two placeholders
    result = launch(2, "tests/distributed_worker.py", folder, "tensor", tmp_path / "out",
                    "--image", images[0], "--image", images[1])
    assert (tmp_path / "out" / "logits.npz").is_file(), result.stdout + result.stderr
    reports = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["vision"] for r in reports] == [True, False]  # the tower on rank 0 only
    model = load_model(folder, dspark=False)
    expected, _ = image_scenario(model, images)
    got = np.load(tmp_path / "out" / "logits.npz")
    assert str(got["records"]) == str(expected.pop("records"))  # rank 0's records on rank 1
    for name, value in expected.items():
        assert np.array_equal(got[name], value), (name, np.abs(got[name] - value).max())
    records = len(str(got["records"]).encode())
    # id and image counts, the records' JSON line (its length, its bytes), ids and types
    # (int32), then whether rank 0 made the rows (int32) and the two spans' rows (bf16):
    # IMAGE rows and delimiters
    rows = int(expected["rows"])
    assert reports[0]["sent"]["image_shared"] == 8 + 4 + records + 2 * rows * 4 + 4 + \
        2 * TWIN_SPAN * model.cfg.hidden_size * 2
    assert generate_main([str(a) for a in generate_args(folder, images)]) == 0
    one = capsys.readouterr().out.split("=" * 10)[1]
    code, text = reports[0]["generate"]
    assert code == 0 and text.split("=" * 10)[1] == one, text


def test_a_followers_prompt_rebuilds_the_token_types(tmp_path):
    """What the server's work line carries of the images (each span's start and grid, through
    JSON) rebuilds rank 0's token types on another rank under tensor parallel (its `inputs`
    then take rank 0's rows); under a pipeline the prompt is all text (no tower there)."""
    from mlx_v41.distributed.prompt import followed_prompt, span_grids
    from mlx_v41.model.vision.prompt import prepare_prompt
    from vision_fixtures import (SMALL_MIN_PIXELS, TWIN_SPAN, prompt_before_expansion,
                                 twin_images, vision_checkpoint)

    model = load_model(vision_checkpoint(tmp_path / "hf", SMALL_MIN_PIXELS), dspark=False)
    prompt = prepare_prompt(model, prompt_before_expansion(), twin_images(tmp_path))
    grids = json.loads(json.dumps(span_grids(prompt)))
    tensor = followed_prompt(rank_group(fake_link(1, 2), False), prompt.ids, grids)
    assert tensor.ids == prompt.ids and tensor.link.rank == 1
    assert np.array_equal(tensor.token_types, prompt.token_types)
    assert (prompt.token_types >= 0).sum() == 2 * TWIN_SPAN  # two spans
    pipeline = followed_prompt(rank_group(fake_link(1, 2), True), prompt.ids, grids)
    assert pipeline.ids == prompt.ids and pipeline.inputs(model) is None


def test_a_followers_job_keeps_rank_0s_image_records(tmp_path):
    """The server's work line carries rank 0's image records: a follower's job (pipeline or
    tensor parallel) reports them as its prompt's, so its cache entries are stored and their
    files named as rank 0's (`--prompt-cache-dir` across ranks finds them again)."""
    from mlx_v41.model.vision.prompt import prepare_prompt
    from mlx_v41.server.engine import Settings
    from mlx_v41.server.engine.ranks import FollowerJob, work_record
    from vision_fixtures import (SMALL_MIN_PIXELS, prompt_before_expansion, twin_images,
                                 vision_checkpoint)

    model = load_model(vision_checkpoint(tmp_path / "hf", SMALL_MIN_PIXELS), dspark=False)
    prompt = prepare_prompt(model, prompt_before_expansion(), twin_images(tmp_path))
    fields = {"logit_bias": None, "repetition_penalty": None, "presence_penalty": None,
              "frequency_penalty": None, "allow_calls": True}
    settings = Settings(max_tokens=5, processor_fields=fields)
    record = json.loads(json.dumps(work_record(
        SimpleNamespace(prompt=prompt, settings=settings, reuse=None))))
    assert len(prompt.records()) == 2
    tokenizer = SimpleNamespace(convert_tokens_to_ids=lambda token: None)
    for group in (rank_group(fake_link(1, 2), False), rank_group(fake_link(1, 2), True)):
        job = FollowerJob(record, group, tokenizer)
        assert job.prompt.ids == prompt.ids and job.prompt.records() == prompt.records()


def test_a_tower_failure_on_rank_0_fails_every_rank_alike(tmp_path):
    """Under tensor parallel the span rows come from rank 0's tower; if it fails there (after
    the prompt was shared), rank 0 raises its error and the others a ValueError naming rank 0,
    instead of waiting for rows that never come (one int32 is shared first)."""
    from mlx_v41.distributed.prompt import SharedImagePrompt, followed_prompt, span_grids
    from mlx_v41.model.vision import prompt as vision_prompt
    from vision_fixtures import (SMALL_MIN_PIXELS, prompt_before_expansion, twin_images,
                                 vision_checkpoint)

    model = load_model(vision_checkpoint(tmp_path / "hf", SMALL_MIN_PIXELS), dspark=False)
    prompt = vision_prompt.prepare_prompt(model, prompt_before_expansion(), twin_images(tmp_path))

    class Link(SimpleNamespace):
        def all_sum(self, x, what):  # the other rank's part: rank 0 failed (1), rows of zeros
            self.calls.append(what)
            return x + 1 if x.dtype == mx.int32 and self.rank != 0 else x

    leader = SharedImagePrompt(prompt.ids, prompt.token_types, prompt.images, prompt.starts,
                               Link(rank=0, size=2, calls=[]))
    assert leader.inputs(model) is not None  # the tower works: its rows are shared
    assert leader.link.calls == ["sharing whether the image rows were made",
                                 "sharing the image rows"]
    broken = SharedImagePrompt(prompt.ids, prompt.token_types, [None] * len(prompt.images),
                               prompt.starts, Link(rank=0, size=2, calls=[]))
    with pytest.raises(Exception) as raised:
        broken.inputs(model)
    assert not isinstance(raised.value, ValueError) or "rank 0 could not" not in str(raised.value)
    assert broken.link.calls == ["sharing whether the image rows were made"]
    follower = followed_prompt(rank_group(Link(rank=1, size=2, calls=[]), False),
                               prompt.ids, json.loads(json.dumps(span_grids(prompt))))
    with pytest.raises(ValueError, match=r"^rank 0 could not compute the image rows \(its "
                                         r"error is on rank 0\); rank 1 stops this call too$"):
        follower.inputs(model)
    assert follower.link.calls == ["sharing whether the image rows were made"]
