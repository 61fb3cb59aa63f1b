"""mlx_v41.inspect: bytes per token from the config, the schedule and the memory plan."""

import subprocess
import sys

import pytest

from mlx_v41.model.config import ModelArgs
from mlx_v41.cli.inspect import global_bytes_per_token, main, parse_bytes, parse_count
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
