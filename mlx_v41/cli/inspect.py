"""`mlx_v41.inspect`: the 43-slot schedule, the cache bytes a config implies, and a memory plan.

    mlx_v41.inspect                           # the bundled official config
    mlx_v41.inspect --model PATH --context 1M --memory 512GB

Bytes per token come from the config (head and index widths, ratios, owner layers) and the
packed record formats of mlx_v41.cache, not from tabulated constants.
"""

from __future__ import annotations

import argparse
import re
import sys

from ..cache.layer import RING_FACTOR, rollback_limit
from ..model.config import ConfigError, ModelArgs, official_config_path
from ..model.memory import (fixed_cache_bytes, global_bytes_per_token,  # noqa: F401 (API)
                            kv_row_bytes, weight_bytes)
from ..model.schedule import ced_halo, decoder_start, format_schedule, layer_roles


def parse_count(text: str) -> int:
    """'1M' -> 1048576, '64K' -> 65536, '4096' -> 4096 (token counts are binary)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (e.g. 4096, 64K, 1M)")
    scale = {"": 1, "k": 1024, "m": 1024 ** 2}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def parse_bytes(text: str) -> int:
    """'512GB' -> 512e9, '192GiB' -> 192 * 2^30, '1TB' -> 1e12."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]i?[bB])\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} (e.g. 512GB, 192GiB)")
    unit = m.group(2).lower()
    power = "kmgt".index(unit[0]) + 1
    base = 1024 if "i" in unit else 1000
    return int(float(m.group(1)) * base ** power)


def _fmt(n: float) -> str:
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def report(args: ModelArgs, context: int, memory: int | None) -> str:
    cfg = args.text_config
    per_token = global_bytes_per_token(cfg)
    fixed = fixed_cache_bytes(cfg)
    main, index = kv_row_bytes(cfg)
    lines = [format_schedule(layer_roles(cfg)), "",
             f"global KV: {per_token:g} bytes/token (main-KV row {main} B + index-key row "
             f"{index} B per group of each kv owner)",
             f"window rings: {_fmt(fixed['window'])} constant ({cfg.num_hidden_layers} layers x "
             f"{RING_FACTOR * cfg.sliding_window} rows x {cfg.head_dim + cfg.head_dim // 32} B)",
             f"compressor input rings: {_fmt(fixed['compressor_inputs'])} constant"]
    start, window = decoder_start(cfg), cfg.sliding_window
    if start < cfg.num_hidden_layers:
        minimal = ced_halo(cfg, context)
        rollback = ced_halo(cfg, context, rollback_limit(window))
        lines.append(
            f"CED prefill: layers 0-{start - 1} over every prompt row; decoder layers "
            f"{start}-{cfg.num_hidden_layers - 1} over a halo of {minimal[0][1]:,} rows at "
            f"layer {start} down to {minimal[-1][1]} at layer {cfg.num_hidden_layers - 1} "
            f"({sum(o for _, o in minimal):,} rows in all; by default "
            f"{sum(o for _, o in rollback) - sum(o for _, o in minimal):,} more so that a trim "
            f"of {rollback_limit(window)} tokens stays exact)")
    session = per_token * context + sum(fixed.values())
    lines.append(f"one session at {context:,} tokens: {_fmt(session)}")
    if memory is not None:
        resident, tables = weight_bytes(args)
        free = memory - resident
        fits = int(free // session) if free > 0 else 0
        lines += [f"weights resident: {_fmt(resident)}; Engram tables memory-mapped: "
                  f"{_fmt(tables)}",
                  f"memory {_fmt(memory)}: {fits} such session(s) fit beside the weights"
                  + ("" if free > 0 else " (the weights alone do not fit)")]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="mlx_v41.inspect", description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="model folder (reads its config.json)")
    source.add_argument("--config", help="a config.json file")
    parser.add_argument("--context", type=parse_count, default=parse_count("1M"),
                        help="context length for the memory plan (default 1M)")
    parser.add_argument("--memory", type=parse_bytes, default=None,
                        help="machine memory, e.g. 512GB: how many sessions fit")
    ns = parser.parse_args(argv)
    path = official_config_path()
    if ns.model:
        path = f"{ns.model}/config.json"
    elif ns.config:
        path = ns.config
    try:
        args = ModelArgs.from_file(path)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report(args, ns.context, ns.memory))
    return 0


if __name__ == "__main__":
    sys.exit(main())
