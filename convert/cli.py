"""Command line: `mlx_v41.convert --hf-path <folder or repo> --mlx-path <out> [-q ...]`, with
mlx-lm's flag names. Bad input ends with one line on stderr and exit status 1."""

from __future__ import annotations

import argparse
import sys

from mlx_v41.model.config import ConfigError
from mlx_v41.errors import CheckpointError
from mlx_v41.sizes import parse_size as size_in_bytes

from .pipeline import DEFAULT_SHARD_SIZE, convert
from .recipes import DTYPES, MODE_DEFAULTS, PRESETS
from .source import ConvertError

def parse_size(text: str) -> int:
    """Bytes from a size (`mlx_v41.sizes`: "5GB", "512MiB", "4096"), at least one."""
    try:
        size = size_in_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a shard size (at least one byte)")
    return size


class ArgumentParser(argparse.ArgumentParser):
    """Reports a bad flag or value on one line, as the other commands' parser (`cli.args`,
    a layer above this package) does."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="mlx_v41.convert",
        description="Convert the published DeepSeek V4.1 Flash checkpoint into an MLX model "
                    "folder: streaming, resumable, atomic.")
    p.add_argument("--hf-path", "--model", required=True,
                   help="published checkpoint: a local folder or a Hugging Face repo id")
    p.add_argument("--mlx-path", default="mlx_model",
                   help="output folder (must not exist or be empty; default: mlx_model)")
    p.add_argument("--revision", help="Hugging Face revision (repo ids only)")
    p.add_argument("-q", "--quantize", action="store_true",
                   help="requantize every quantized module from the official values")
    p.add_argument("--q-group-size", type=int, help="group size (default per mode, as mlx-lm)")
    p.add_argument("--q-bits", type=int, help="bits per weight (default per mode, as mlx-lm)")
    p.add_argument("--q-mode", default="affine", choices=sorted(MODE_DEFAULTS),
                   help="quantization mode (default: affine)")
    p.add_argument("--quant-predicate", choices=sorted(PRESETS),
                   help="mixed preset: mixed_E_8 = routed experts at E bits (--q-mode, "
                        "--q-group-size), every other module at the official 8-bit FP8")
    p.add_argument("--dtype", choices=sorted(DTYPES),
                   help="storage dtype of the BF16 float tensors (default: as stored)")
    p.add_argument("--drop-vision", action="store_true", help="leave out the vision tower")
    p.add_argument("--drop-dspark", action="store_true", help="leave out the DSpark drafter")
    p.add_argument("--shard-size", type=parse_size, default=DEFAULT_SHARD_SIZE,
                   help="bytes per output file (default: 5GB)")
    p.add_argument("--dry-run", action="store_true",
                   help="check the input and print the output sizes; write nothing")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        convert(args.hf_path, args.mlx_path, quantize=args.quantize, q_bits=args.q_bits,
                q_group_size=args.q_group_size, q_mode=args.q_mode,
                quant_predicate=args.quant_predicate, dtype=args.dtype,
                drop_vision=args.drop_vision, drop_dspark=args.drop_dspark,
                shard_size=args.shard_size, revision=args.revision, dry_run=args.dry_run,
                progress=not args.quiet)
    except (ConvertError, CheckpointError, ConfigError) as e:
        message = " ".join(str(e).split())
        print(f"mlx_v41.convert: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("mlx_v41.convert: interrupted; re-run the same command to resume",
              file=sys.stderr)
        return 130
    return 0
