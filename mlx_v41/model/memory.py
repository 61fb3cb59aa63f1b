"""What a config implies in bytes: the length-dependent global KV per token, the constant
per-sequence state, one session's cache, and the weights as this package holds them. From
the config (head and index widths, ratios, owner layers) and the packed record formats of
`mlx_v41.cache`, not from tabulated constants. `mlx_v41.inspect` prints them; the server
admits sessions by them."""

from __future__ import annotations

from mlx.utils import tree_flatten

from ..cache.layer import RING_FACTOR
from .config import ModelArgs, TextConfig
from .schedule import FULL, layer_roles

FP32_BYTES = 4


def human_bytes(n: float) -> str:
    """'279.72 GB', '18.80 MB', '512 B' (decimal units, as mlx-lm prints memory)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def kv_row_bytes(cfg: TextConfig) -> tuple[int, int]:
    """Packed main-KV row (E2M1 codes + E4M3 per 16) and index-key row (codes + E8M0 per 32)."""
    return cfg.head_dim // 2 + cfg.head_dim // 16, cfg.index_head_dim // 2 + \
        cfg.index_head_dim // 32


def global_bytes_per_token(cfg: TextConfig) -> float:
    """Length-dependent cache bytes per token: each kv owner stores one row pair per group."""
    main, index = kv_row_bytes(cfg)
    owners = [r for r in layer_roles(cfg)[:cfg.num_hidden_layers] if r.mode == FULL]
    return sum((main + index) / r.ratio for r in owners)


def fixed_cache_bytes(cfg: TextConfig, drafter: bool = False) -> dict:
    """Constant per-sequence state: window rings, the ratio-2 compressors' input rings and
    open groups, and with the DSpark `drafter` its stages' rings (one row wider)."""
    ring = RING_FACTOR * cfg.sliding_window
    row = cfg.head_dim + cfg.head_dim // 32
    window = cfg.num_hidden_layers * ring * row
    owners = [r for r in layer_roles(cfg)[:cfg.num_hidden_layers] if r.mode == FULL
              and r.ratio > 1]
    inputs = len(owners) * ring * 2 * cfg.head_dim * FP32_BYTES
    out = {"window": window, "compressor_inputs": inputs,
           "open_groups": len(owners) * 2 * cfg.head_dim * FP32_BYTES}
    if drafter:
        stages = len(cfg.compress_ratios) - cfg.num_hidden_layers
        out["draft_rings"] = stages * RING_FACTOR * (cfg.sliding_window + 1) * row
    return out


def session_bytes(cfg: TextConfig, tokens: int, drafter: bool = False) -> int:
    """One sequence's cache at `tokens` positions (global KV + the constant state, with the
    DSpark `drafter`'s rings when it is loaded); the compressed rows grow in pages, so a live
    cache may hold up to a page more."""
    return int(global_bytes_per_token(cfg) * tokens
               + sum(fixed_cache_bytes(cfg, drafter).values()))


def weight_bytes(args: ModelArgs) -> tuple[int, int]:
    """(resident weights, memory-mapped Engram tables) of the model as this package holds it."""
    from .engram import EngramTable
    from .model import Model

    model = Model(args)  # parameters stay lazy: nothing is allocated
    resident = sum(value.nbytes for _, value in tree_flatten(model.parameters()))
    tables = sum(m.nbytes for _, m in model.named_modules() if isinstance(m, EngramTable))
    return resident, tables
