"""`mlx_v41.inspect`: the 43-slot schedule, the cache bytes a config implies, and a memory plan.

    mlx_v41.inspect                           # the bundled official config
    mlx_v41.inspect --model PATH --context 1M --memory 512GB
    mlx_v41.inspect --memory 128GB --context 128K --sessions 2 --hit-rate 0.9
    mlx_v41.inspect --mac-table               # docs/memory.md's table

Bytes per token come from the config (head and index widths, ratios, owner layers) and the
packed record formats of mlx_v41.cache, not from tabulated constants; the weights per
conversion recipe from the model's own module layouts (`model.memory.recipe_bytes`).
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..cache.layer import RING_FACTOR, rollback_limit
from ..checkpoint.converted import read_manifest
from ..checkpoint.demo import ensure_demo_checkpoint
from ..checkpoint.source import DEMO
from ..checkpoint.streaming import (AUTO, KV_RESERVE_FRACTION, KV_RESERVE_TOKENS, ExpertPlan,
                                    plan_experts)
from ..errors import CheckpointError
from ..sizes import parse_size
from ..model.config import ConfigError, ModelArgs, TextConfig, official_config_path
from ..model.memory import (RECIPES, RecipeBytes, fixed_cache_bytes,  # noqa: F401 (API)
                            global_bytes_per_token, human_bytes, kv_row_bytes, recipe_bytes,
                            session_bytes, weight_bytes)
from ..model.schedule import ced_halo, decoder_start, format_schedule, layer_roles
from .args import ArgumentParser

# What MLX reports as max_recommended_working_set_size on a large Mac: about 75% of its RAM.
MAC_WORKING_SET_FRACTION = 0.75
MAC_MEMORY_GB = (36, 64, 96, 128, 192, 256, 512)  # Apple's GB: binary, 128 GB = 128 GiB
MAC_HIT_RATES = (0.8, 0.9)
DEFAULT_SSD_BANDWIDTH = 7 * 10**9  # bytes/s: about the sequential reads of a recent Mac SSD
DEFAULT_HIT_RATE = 0.8


def parse_count(text: str) -> int:
    """'1M' -> 1048576, '64K' -> 65536, '4096' -> 4096 (token counts are binary)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", text)
    count = int(float(m.group(1)) * {"": 1, "k": 1024, "m": 1024 ** 2}[m.group(2).lower()]) \
        if m else 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (e.g. 4096, 64K, 1M)")
    return count


def parse_bytes(text: str) -> int:
    """Bytes from a size with its unit (`mlx_v41.sizes`: "512GB", "192GiB", "1TB"): a
    machine's memory or bandwidth as a bare number ("128") is taken for a mistake."""
    try:
        size = parse_size(text) if re.search(r"[A-Za-z]\s*$", text) else 0
    except ValueError:
        size = 0
    if size < 1:
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} (with its unit, e.g. "
                                         "512GB, 192GiB)")
    return size


def parse_rate(text: str) -> int:
    """'7GB/s' -> 7e9 bytes per second ('/s' optional)."""
    try:
        return parse_bytes(re.sub(r"/s\s*$", "", text))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"not a bandwidth: {text!r} (e.g. 7GB/s, 3.5GB/s)") \
            from None


def parse_hit_rate(text: str) -> float:
    """A fraction of routed experts found in memory, in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"not a hit rate: {text!r} (a fraction in [0, 1), "
                                         "e.g. 0.8)")
    return value


def parse_sessions(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"not a number of sessions: {text!r} (1 or more)")
    return int(text)


def _fmt(n: float) -> str:
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


@dataclass(frozen=True)
class Options:
    """What the memory plan is asked about (the command's flags)."""

    context: int
    memory: Optional[int] = None      # the machine's RAM
    sessions: int = 1
    hit_rate: float = DEFAULT_HIT_RATE
    bandwidth: int = DEFAULT_SSD_BANDWIDTH  # SSD bytes per second

    @property
    def working_set(self) -> Optional[int]:
        return None if self.memory is None else int(self.memory * MAC_WORKING_SET_FRACTION)


def report(args: ModelArgs, context: int, memory: Optional[int] = None, sessions: int = 1,
           hit_rate: float = DEFAULT_HIT_RATE, bandwidth: int = DEFAULT_SSD_BANDWIDTH,
           own: Optional[RecipeBytes] = None) -> str:
    """The schedule, the cache bytes, the weights per recipe and with `memory` (the machine's
    RAM) the sessions and expert budgets that fit; `own`: the config's own recipe (default:
    its quantization block)."""
    cfg = args.text_config
    options = Options(context, memory, sessions, hit_rate, bandwidth)
    own = own or own_recipe(args)
    session = session_bytes(cfg, context)
    lines = [format_schedule(layer_roles(cfg)), "", *_cache_lines(cfg, context),
             f"one session at {context:,} tokens: {_fmt(session)}"]
    if memory is not None:
        lines += _memory_lines(cfg, options, own, session)
    lines += recipe_lines(recipe_rows(args, own), cfg, options)
    if isinstance(args.quantization, dict):
        lines.append(f"{own.name}: the layout of this config's quantization block")
    return "\n".join(lines)


def _cache_lines(cfg: TextConfig, context: int) -> list:
    fixed = fixed_cache_bytes(cfg)
    main, index = kv_row_bytes(cfg)
    lines = [f"global KV: {global_bytes_per_token(cfg):g} bytes/token (main-KV row {main} B + "
             f"index-key row {index} B per group of each kv owner)",
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
    return lines


def _memory_lines(cfg: TextConfig, options: Options, own: RecipeBytes, session: int) -> list:
    weights, work = own.resident + own.experts, options.working_set
    plan = expert_plan(own, cfg, work, options.sessions * session)
    head = f"memory {_fmt(options.memory)} (working set ~{_fmt(work)}): "
    lines = [f"weights resident: {_fmt(weights)}; Engram tables memory-mapped: "
             f"{_fmt(own.tables)}"]
    if plan is None:
        return lines + [head + "the weights do not fit, not even with the routed experts "
                        f"streamed ({human_bytes(own.resident)} of other weights and at least "
                        f"{human_bytes(own.minimum)} of expert slots)"]
    if not plan.streamed:
        fits = (work - weights) // session
        return lines + [head + f"{fits} such session(s) fit beside the weights"]
    return lines + [head + f"the weights do not fit resident; streamed from SSD: a "
                    f"{human_bytes(plan.budget)} expert budget beside {options.sessions} "
                    "such session(s)"]


def expert_plan(sizes: RecipeBytes, cfg: TextConfig, working_set: int,
                kv: Optional[int] = None) -> Optional[ExpertPlan]:
    """The plan of `--expert-memory auto` on `working_set` bytes with at least `kv` bytes kept
    for caches (default: auto's, one session of KV_RESERVE_TOKENS tokens); None: even the
    smallest expert budget does not fit."""
    try:
        return plan_experts(AUTO, sizes.experts, sizes.resident, sizes.minimum, cfg,
                            working_set, kv)
    except ValueError:
        return None


def own_recipe(args: ModelArgs, folder: Optional[str] = None) -> RecipeBytes:
    """The recipe of the config itself: its quantization block, named after the conversion
    manifest's recipe in `folder` when there is one ("official": no block)."""
    if not isinstance(args.quantization, dict):
        return recipe_bytes(args)
    name = "this config"
    if folder is not None:
        try:
            name = read_manifest(Path(folder))["recipe"]["name"]
        except (CheckpointError, KeyError, TypeError):
            pass
    return recipe_bytes(args, name, args.quantization)


def recipe_rows(args: ModelArgs, own: RecipeBytes) -> list:
    """The presets' `RecipeBytes`, the config's own layout in place of its preset's (or last)."""
    rows = [own if name == own.name else recipe_bytes(args, name) for name in RECIPES]
    return rows if own.name in RECIPES else rows + [own]


def decode_bound(sizes: RecipeBytes, hit_rate: float, bandwidth: int) -> float:
    """Decode tokens per second the SSD allows: its bandwidth over the bytes a token reads."""
    return bandwidth / sizes.token_bytes(hit_rate)


def recipe_lines(rows: list, cfg: TextConfig, options: Options) -> list:
    hit, rate = options.hit_rate, human_bytes(options.bandwidth)
    header = ["recipe", "resident", "experts", "one expert", f"SSD/token at hit rate {hit:g}",
              f"decode bound at {rate}/s"]
    if options.memory is not None:
        header += ["on this memory", "expert budget"]
    table = []
    for sizes in rows:
        row = [sizes.name, human_bytes(sizes.resident), human_bytes(sizes.experts),
               human_bytes(sizes.expert), human_bytes(sizes.token_bytes(hit)),
               f"{decode_bound(sizes, hit, options.bandwidth):.2f} tok/s"]
        if options.memory is not None:
            kv = options.sessions * session_bytes(cfg, options.context)
            row += _plan_cells(expert_plan(sizes, cfg, options.working_set, kv))
        table.append(row)
    lines = ["", "per recipe (resident: every weight but the routed experts; SSD/token: the "
             "routed-expert bytes one decode token reads when streamed):", *_columns(header, table)]
    if options.memory is not None:
        lines.append(f"expert budget: what fits the working set beside {options.sessions} "
                     f"session(s) of {options.context:,} tokens (at least "
                     f"{KV_RESERVE_FRACTION:.0%} of it kept for caches)")
    return lines


def _plan_cells(plan: Optional[ExpertPlan]) -> list:
    if plan is None:
        return ["does not fit", "-"]
    if not plan.streamed:
        return ["resident", "all"]
    return ["streamed", f"{human_bytes(plan.budget)} ({plan.budget / plan.expert_bytes:.0%})"]


def _columns(header: list, rows: list) -> list:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return ["  " + "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
            for r in [header, *rows]]


def mac_table(args: ModelArgs) -> str:
    """docs/memory.md's table: each Mac x each preset, as `--expert-memory auto` plans it."""
    cfg = args.text_config
    rows = [recipe_bytes(args, name) for name in RECIPES]
    bounds = " | ".join(f"decode bound, hit rate {h:g}" for h in MAC_HIT_RATES)
    lines = [f"| Mac | recipe | runs resident? | expert budget | {bounds} |",
             "|---|---|---|---|" + "---|" * len(MAC_HIT_RATES)]
    for gb in MAC_MEMORY_GB:
        work = int(gb * 2**30 * MAC_WORKING_SET_FRACTION)
        for sizes in rows:
            lines.append(f"| {gb} GB | {sizes.name} | {_mac_cells(sizes, cfg, work)} |")
    return "\n".join(lines)


def _mac_cells(sizes: RecipeBytes, cfg: TextConfig, work: int) -> str:
    plan = expert_plan(sizes, cfg, work)
    if plan is None:
        return " | ".join(["does not fit", "-"] + ["-"] * len(MAC_HIT_RATES))
    if not plan.streamed:
        return " | ".join(["yes", "all experts"] + ["no SSD reads"] * len(MAC_HIT_RATES))
    bounds = [f"{decode_bound(sizes, h, DEFAULT_SSD_BANDWIDTH):.1f} tok/s" for h in MAC_HIT_RATES]
    return " | ".join(["no", f"{human_bytes(plan.budget)} ({plan.budget / sizes.experts:.0%})",
                       *bounds])


def mac_table_notes() -> str:
    return (f"Working set: {MAC_WORKING_SET_FRACTION:.0%} of the Mac's memory (about what MLX "
            "reports as max_recommended_working_set_size); expert budget: what "
            f"`--expert-memory auto` keeps beside one session of {KV_RESERVE_TOKENS // 1024}K "
            f"tokens; decode bound: {human_bytes(DEFAULT_SSD_BANDWIDTH)}/s of SSD reads over the "
            "routed-expert bytes a token misses (an upper bound: compute is not counted, and the "
            "hit rate a budget reaches depends on the workload's routing; a small budget reaches "
            "less). Measured for comparison: ds4 decodes a 2-bit V4.1 Flash streamed from SSD at "
            "15-16 tok/s on an M5 Max with 128 GB.")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="mlx_v41.inspect", description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="model folder (reads its config.json), or 'demo'")
    source.add_argument("--config", help="a config.json file")
    add = parser.add_argument
    add("--context", type=parse_count, default=None,
        help="context length for the memory plan, at most the model's (default: the model's "
             "max_position_embeddings, 1M)")
    add("--memory", type=parse_bytes, default=None,
        help="the machine's memory, e.g. 128GB: sessions and expert budgets that fit (the "
             f"plan uses {MAC_WORKING_SET_FRACTION:.0%} of it, a Mac's working set)")
    add("--sessions", type=parse_sessions, default=1,
        help="sessions of --context tokens the expert budget leaves room for (default 1)")
    add("--hit-rate", type=parse_hit_rate, default=DEFAULT_HIT_RATE,
        help=f"share of routed experts found in memory, in [0, 1) (default {DEFAULT_HIT_RATE})")
    add("--ssd-bandwidth", type=parse_rate, default=DEFAULT_SSD_BANDWIDTH,
        help="SSD read bandwidth for the decode bound (default 7GB/s)")
    add("--mac-table", action="store_true",
        help="print the markdown table of docs/memory.md (each Mac x each recipe) and exit")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        folder = str(ensure_demo_checkpoint()) if ns.model == DEMO else ns.model
        args = ModelArgs.from_file(f"{folder}/config.json" if folder else
                                   ns.config or official_config_path())
    except (ConfigError, OSError) as e:  # OSError: the demo checkpoint could not be written
        print(f"error: {e}", file=sys.stderr)
        return 2
    if ns.mac_table:
        print(mac_table(args) + "\n\n" + mac_table_notes())
        return 0
    limit = args.text_config.max_position_embeddings
    if ns.context is not None and ns.context > limit:
        parser.error(f"argument --context: {ns.context:,} tokens exceed the model's context of "
                     f"{limit:,} (max_position_embeddings)")
    context = limit if ns.context is None else ns.context
    print(report(args, context, ns.memory, ns.sessions, ns.hit_rate, ns.ssd_bandwidth,
                 own_recipe(args, folder)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
