"""Byte sizes: one grammar (mlx_v41/sizes.py) for every flag that takes one, so a size a user
types means the same bytes to every command, and a bad one is refused by each on one line
naming it."""

import subprocess
import sys

import pytest

from convert.cli import build_parser as convert_parser
from mlx_v41.cli.generate import setup_arg_parser as generate_parser
from mlx_v41.cli.inspect import build_parser as inspect_parser
from mlx_v41.cli.server import setup_arg_parser as server_parser
from mlx_v41.checkpoint.streaming import parse_memory_size
from mlx_v41.sizes import parse_size

FLAGS = {  # command: (parser, the arguments before the size, the parsed attribute)
    "server --kv-budget": (server_parser, ["--model", "m", "--kv-budget"], "kv_budget"),
    "server --prompt-cache-bytes": (server_parser, ["--model", "m", "--prompt-cache-bytes"],
                                    "prompt_cache_bytes"),
    "server --max-image-bytes": (server_parser, ["--model", "m", "--max-image-bytes"],
                                 "max_image_bytes"),
    "generate --expert-memory": (generate_parser, ["--model", "m", "--expert-memory"],
                                 "expert_memory"),
    "convert --shard-size": (convert_parser, ["--hf-path", "m", "--shard-size"], "shard_size"),
    "inspect --memory": (inspect_parser, ["--memory"], "memory"),
}
SIZES = [("48GB", 48 * 10**9), ("40GiB", 40 * 2**30), ("512mib", 512 * 2**20),
         ("4G", 4 * 10**9), ("2t", 2 * 10**12), ("1TB", 10**12), ("1.5K", 1500),
         ("2.5e3K", 2.5 * 10**6), (" 3 GB ", 3 * 10**9), ("7b", 7)]
BYTES = [("1e9", 10**9), ("4096", 4096)]  # bare numbers of bytes: not a machine's memory
BAD = ["12XB", "GB", "-1", "", "1e999", "4 G B"]


@pytest.mark.parametrize("flag", FLAGS)
@pytest.mark.parametrize("text,value", SIZES + BYTES)
def test_every_size_flag_reads_a_size_alike(flag, text, value):
    parser, before, attribute = FLAGS[flag]
    if flag == "inspect --memory" and (text, value) in BYTES:
        with pytest.raises(SystemExit):  # "--memory 128" is taken for a mistake
            parser().parse_args([*before, text])
        return
    assert getattr(parser().parse_args([*before, text]), attribute) == value
    assert parse_size(text) == parse_memory_size(text) == value  # the API's expert_memory=


@pytest.mark.parametrize("flag", FLAGS)
def test_a_bad_size_is_refused_on_one_line_naming_it(flag, capsys):
    parser, before, _ = FLAGS[flag]
    for text in BAD:
        with pytest.raises(SystemExit) as info:
            parser().parse_args([*before, text])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and repr(text) in err and before[-1] in err, err


def test_zero_bytes_is_a_size_only_where_it_means_something():
    """`--prompt-cache-bytes 0` turns prompt reuse off; a shard, an expert budget and a
    machine's memory need at least a byte."""
    assert server_parser().parse_args(["--model", "m", "--prompt-cache-bytes", "0"]) \
        .prompt_cache_bytes == 0
    for flag in ("generate --expert-memory", "convert --shard-size", "inspect --memory"):
        parser, before, _ = FLAGS[flag]
        with pytest.raises(SystemExit):
            parser().parse_args([*before, "0"])
    with pytest.raises(ValueError, match="expert_memory: '0' is not a memory size"):
        parse_memory_size("0")


def test_the_size_error_is_one_line_from_the_command():
    run = subprocess.run([sys.executable, "-m", "mlx_v41.convert", "--hf-path", "m",
                          "--shard-size", "5 GiG"], capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert "--shard-size: '5 GiG' is not a size (e.g. 48GB" in run.stderr
