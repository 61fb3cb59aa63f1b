"""mlx_v41.inspect: bytes per token from the config, the schedule and the memory plan."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_v41.checkpoint.streaming import AUTO, plan_experts
from mlx_v41.model.config import ModelArgs
from mlx_v41.cli.inspect import (expert_plan, global_bytes_per_token, mac_table, main,
                                 parse_bytes, parse_count)
from mlx_v41.model.memory import RECIPES, recipe_bytes, weight_bytes
from conftest import golden_checkpoint


def test_official_config_is_890_bytes_per_token():
    # 3 ratio-2 owners x (288 + 68) / 2 + 1 ratio-1 owner x (288 + 68): spec cache.md §2
    assert global_bytes_per_token(ModelArgs().text_config) == 890


def test_official_ced_halo_matches_the_spec_table():
    """cache.md §4.2: layer 20 reads 2541 window rows and computes 2414; layer 21 2414 / 2287;
    127 fewer per layer; the last layer computes 1 row."""
    from mlx_v41.model.schedule import ced_halo

    cfg = ModelArgs().text_config
    spans = ced_halo(cfg, 10 ** 6)
    assert spans[:2] == [(2541, 2414), (2414, 2287)] and spans[-1] == (128, 1)
    assert len(spans) == 20
    assert ced_halo(cfg, 10 ** 6, rollback=129)[0] == (2541 + 128, 2414 + 128)
    assert ced_halo(cfg, 100)[0] == (100, 100)  # a short prompt: every row


def test_tiny_config_bytes_per_token():
    args = ModelArgs.from_file(golden_checkpoint("tiny") / "config.json")
    # head_dim 64 -> 32 + 4 B, index_head_dim 32 -> 16 + 1 B; owners 2, 5 (ratio 2) and 7
    assert global_bytes_per_token(args.text_config) == 2 * 53 / 2 + 53


def test_cli_prints_schedule_and_plan(capsys):
    assert main(["--context", "1M", "--memory", "512GB"]) == 0
    out = capsys.readouterr().out
    assert "global KV: 890 bytes/token" in out
    assert out.count("\n  2") >= 1 and "reindex" in out and "draft" in out
    assert "session(s) fit beside the weights" in out
    assert "5.16 MiB" in out  # 40 x 256 x 528 B window rings
    assert "halo of 2,414 rows at layer 20 down to 1 at layer 39" in out


def test_cli_reads_a_model_folder(capsys):
    assert main(["--model", str(golden_checkpoint("tiny")), "--context", "4096"]) == 0
    assert "global KV: 106 bytes/token" in capsys.readouterr().out


def test_cli_reads_the_demo_model(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # built there, as --model demo does
    assert main(["--model", "demo", "--context", "4K"]) == 0
    out = capsys.readouterr().out
    assert "global KV: 106 bytes/token" in out and "one session at 4,096 tokens" in out


def test_context_is_bounded_by_the_models(capsys, tmp_path):
    config = json.loads((golden_checkpoint("tiny") / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = 4096
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["--config", str(path)]) == 0  # the default: the model's context
    assert "one session at 4,096 tokens" in capsys.readouterr().out
    for argv, words in ((["--config", str(path), "--context", "8K"], "8,192 tokens exceed the "
                         "model's context of 4,096 (max_position_embeddings)"),
                        (["--context", "99999999999"], "context of 1,048,576"),
                        (["--context", "0"], "not a token count: '0'")):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.count("\n") == 1 and words in err, err


@pytest.mark.slow
def test_cli_bad_input_is_one_line():
    run = subprocess.run([sys.executable, "-m", "mlx_v41", "inspect", "--model", "/nonexistent"],
                         capture_output=True, text=True)
    assert run.returncode == 2
    assert run.stderr.strip().count("\n") == 0 and "config.json" in run.stderr


@pytest.mark.parametrize("text,value", [("1M", 1048576), ("64K", 65536), ("4096", 4096)])
def test_parse_count(text, value):
    assert parse_count(text) == value


@pytest.mark.parametrize("text,value", [("512GB", 512 * 10**9), ("192GiB", 192 * 2**30)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


# ---------------------------------------------------------------- the planner (per recipe)

# The published shapes: hidden 5120, moe_intermediate 2304, 384 experts, top-6, 40 MoE layers.
PROJ_VALUES = 3 * 5120 * 2304       # one expert's gate, up and down weights
LAYERS, EXPERTS, TOP_K = 40, 384, 6
OFFICIAL_EXPERT = PROJ_VALUES * 4.25 / 8  # mxfp4: 4 bits + one uint8 E8M0 scale per 32


def affine_expert(bits: int) -> float:
    """Affine, group 64: `bits` per value + a bf16 scale and a bf16 bias per 64 values."""
    return PROJ_VALUES * (bits / 8 + 4 / 64)


PUBLISHED_EXPERT = {"official": OFFICIAL_EXPERT, "mixed_4_8": affine_expert(4),
                    "mixed_3_8": affine_expert(3), "mixed_2_8": affine_expert(2)}
# Every weight of the text model but its routed experts (pinned: the lazy skeleton's bytes)
OFFICIAL_RESIDENT = 11_567_268_288
# One official session: 890 B/token + window rings, compressor input rings and open groups
FIXED = 40 * 256 * 528 + 3 * 256 * 2 * 512 * 4 + 3 * 2 * 512 * 4
SESSION_1M = 890 * 2**20 + FIXED


def table_row(out: str, name: str) -> list:
    """The cells of recipe `name`'s row in inspect's per-recipe table."""
    line = next(x for x in out.splitlines() if x.startswith(f"  {name} "))
    return re.split(r"\s{2,}", line.strip())


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def test_recipe_bytes_match_the_published_sizes():
    assert OFFICIAL_EXPERT == 18_800_640
    args = ModelArgs()
    for name in RECIPES:
        sizes = recipe_bytes(args, name)
        expert = PUBLISHED_EXPERT[name]
        assert (sizes.expert, sizes.minimum) == (expert, expert), name
        assert sizes.experts == LAYERS * EXPERTS * expert, name
        assert sizes.decode == LAYERS * TOP_K * expert, name
        assert sizes.resident == OFFICIAL_RESIDENT, name  # only the experts change
    assert weight_bytes(args)[0] == OFFICIAL_RESIDENT + LAYERS * EXPERTS * OFFICIAL_EXPERT


def test_presets_equal_the_converters_recipes():
    """The presets' layouts here are the converter's (`make_recipe`'s quantization block)."""
    from mlx_v41.convert.recipes import make_recipe
    from mlx_v41.model.model import Model

    args = ModelArgs()
    for name in RECIPES[1:]:
        block = make_recipe(Model(args), quant_predicate=name).quantization()
        assert recipe_bytes(args, name, block) == recipe_bytes(args, name), name


def test_cli_prints_the_recipes_without_memory(capsys):
    assert main(["--context", "128K"]) == 0
    out = capsys.readouterr().out
    for name, expert in PUBLISHED_EXPERT.items():
        row = table_row(out, name)
        assert row[1:4] == [gb(OFFICIAL_RESIDENT), gb(LAYERS * EXPERTS * expert),
                            f"{expert / 1e6:.2f} MB"], row
        assert len(row) == 6  # no memory, no plan columns


def test_decode_bound_arithmetic(capsys):
    assert main(["--hit-rate", "0.9", "--ssd-bandwidth", "6GB/s"]) == 0
    out = capsys.readouterr().out
    for name, expert in PUBLISHED_EXPERT.items():
        per_token = LAYERS * TOP_K * expert * (1 - 0.9)
        row = table_row(out, name)
        assert row[4:6] == [f"{per_token / 1e6:.2f} MB", f"{6e9 / per_token:.2f} tok/s"], row
    assert main([]) == 0  # defaults: hit rate 0.8, 7 GB/s; 902.43 MB -> 7.76 tok/s
    assert table_row(capsys.readouterr().out, "official")[4:6] == ["902.43 MB", "7.76 tok/s"]


def test_resident_or_streamed_at_small_and_large_memory(capsys):
    assert main(["--memory", "512GB", "--context", "128K"]) == 0
    out = capsys.readouterr().out
    assert all(table_row(out, name)[6:] == ["resident", "all"] for name in RECIPES)
    assert main(["--memory", "128GB", "--context", "128K"]) == 0
    out = capsys.readouterr().out
    work = 128e9 * 0.75
    budget = work - 0.1 * work - OFFICIAL_RESIDENT  # the 10% reserve beats one 128K session
    for name, expert in PUBLISHED_EXPERT.items():
        share = budget / (LAYERS * EXPERTS * expert)
        assert table_row(out, name)[6:] == ["streamed", f"{gb(budget)} ({share:.0%})"], name
    assert f"the weights do not fit resident; streamed from SSD: a {gb(budget)} expert " \
        "budget beside 1 such session(s)" in out
    assert "(the weights alone do not fit)" not in out
    assert main(["--memory", "8GB"]) == 0
    assert "the weights do not fit, not even with the routed experts streamed" in \
        capsys.readouterr().out


def test_budget_shrinks_by_the_sessions_kv(capsys):
    """Past the 10% floor every 1M-token session takes its bytes from the expert budget."""
    work = 128e9 * 0.75
    assert 10 * SESSION_1M < 0.1 * work < 11 * SESSION_1M
    for sessions in (11, 12):
        assert main(["--memory", "128GB", "--context", "1M", "--sessions", str(sessions)]) == 0
        budget = work - sessions * SESSION_1M - OFFICIAL_RESIDENT
        assert table_row(capsys.readouterr().out, "official")[7].startswith(gb(budget))
    args = ModelArgs()
    cfg, sizes = args.text_config, recipe_bytes(args)
    budgets = [expert_plan(sizes, cfg, int(work), n * SESSION_1M).budget
               for n in (11, 12, 13)]
    assert budgets[0] - budgets[1] == budgets[1] - budgets[2] == SESSION_1M


def test_one_128k_session_is_what_auto_plans():
    args = ModelArgs()
    cfg = args.text_config
    for name in RECIPES:
        sizes = recipe_bytes(args, name)
        for work in (27 * 10**9, 96 * 10**9, 150 * 10**9, 384 * 10**9):
            auto = plan_experts(AUTO, sizes.experts, sizes.resident, sizes.minimum, cfg, work)
            ours = expert_plan(sizes, cfg, work, 131072 * 890 + FIXED)
            assert (ours.streamed, ours.budget) == (auto.streamed, auto.budget), (name, work)


@pytest.mark.parametrize("flag,value,words", [
    ("--hit-rate", "1", "not a hit rate: '1'"), ("--hit-rate", "-0.1", "not a hit rate"),
    ("--hit-rate", "most", "not a hit rate"), ("--ssd-bandwidth", "fast", "not a bandwidth"),
    ("--ssd-bandwidth", "7", "not a bandwidth"), ("--sessions", "0", "not a number of sessions"),
    ("--memory", "128", "not a memory size"), ("--context", "long", "not a token count")])
def test_bad_flag_values_are_one_line(capsys, flag, value, words):
    with pytest.raises(SystemExit) as exit_info:
        main([flag, value])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert f"error: argument {flag}: {words}" in err


def test_mac_table_rows_and_the_docs_copy(capsys):
    assert main(["--mac-table"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "GB |" in line]
    assert len(rows) == 7 * 4
    work = 128 * 2**30 * 0.75
    budget = work * 0.9 - OFFICIAL_RESIDENT
    bounds = [7e9 / (LAYERS * TOP_K * affine_expert(2) * (1 - h)) for h in (0.8, 0.9)]
    assert f"| 128 GB | mixed_2_8 | no | {gb(budget)} (" \
        f"{budget / (LAYERS * EXPERTS * affine_expert(2)):.0%}) | {bounds[0]:.1f} tok/s | " \
        f"{bounds[1]:.1f} tok/s |" in rows
    assert all("| yes | all experts |" in r for r in rows if r.startswith("| 512 GB"))
    assert all("| no |" in r for r in rows if r.startswith("| 36 GB"))
    docs = (Path(__file__).parents[1] / "docs" / "memory.md").read_text()
    assert mac_table(ModelArgs()) in docs, "regenerate it: mlx_v41.inspect --mac-table"


def test_converted_folder_row_reads_its_quantization(tmp_path, capsys):
    from mlx_v41.convert import convert

    folder = convert(golden_checkpoint("tiny"), tmp_path / "m", quant_predicate="mixed_3_8",
                     q_group_size=32, progress=False, log=lambda line: None)
    assert main(["--model", str(folder)]) == 0
    out = capsys.readouterr().out
    # tiny: hidden 128, moe_intermediate 64; 3 bits + bf16 scale and bias per 32 values
    assert table_row(out, "mixed_3_8")[3] == f"{3 * 128 * 64 * (3 / 8 + 4 / 32) / 1e3:.2f} KB"
    assert table_row(out, "mixed_2_8")[3] == f"{3 * 128 * 64 * (2 / 8 + 4 / 64) / 1e3:.2f} KB"
    assert "mixed_3_8: the layout of this config's quantization block" in out


def test_convert_dry_run_prints_the_memory_plan(tmp_path, capsys, monkeypatch):
    import mlx_v41.convert.pipeline as pipeline
    from mlx_v41.convert.cli import main as convert_main
    from mlx_v41.model.memory import session_bytes

    argv = ["--hf-path", str(golden_checkpoint("tiny")), "--mlx-path", str(tmp_path / "m"),
            "--quant-predicate", "mixed_2_8", "--dry-run", "--quiet"]
    assert convert_main(argv) == 0
    out = capsys.readouterr().out
    expert = 3 * 128 * 64 * (2 / 8 + 4 / 64)  # 12 MoE layers x 8 experts
    assert f"routed experts {12 * 8 * expert / 1e3:.2f} KB ({expert / 1e3:.2f} KB each" in out
    assert "recipe mixed_2_8:" in out and "output:" in out  # the lines it printed before
    assert "this machine: experts: resident (" in out
    args = ModelArgs.from_file(golden_checkpoint("tiny") / "config.json")
    resident = recipe_bytes(args, "mixed_2_8").resident
    work = resident + session_bytes(args.text_config, 131072) + 400_000
    monkeypatch.setattr(pipeline, "working_set", lambda: work)
    assert convert_main(argv) == 0
    assert "this machine: experts: streamed from SSD, 400.00 KB of 737.28 KB in memory" in \
        capsys.readouterr().out
    assert not (tmp_path / "m").exists()


def test_convert_bad_flag_values_are_one_line(capsys):
    from mlx_v41.convert.cli import main as convert_main

    for flags in (["--shard-size", "lots"], ["--q-bits", "many"]):
        with pytest.raises(SystemExit) as exit_info:
            convert_main(["--hf-path", "x", *flags])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.count("\n") == 1, err
        assert err.startswith(f"mlx_v41.convert: error: argument {flags[0]}: ")
