"""Per-layer roles of the 43-slot schedule, computed once from the config.

SWA-only, Full (owns compressed KV and index keys), Reindex (own indexer query over an owner's
keys) and Reuse (owner's KV and selection) layers; plus Engram placement, DSpark stages and taps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .config import TextConfig

SWA, FULL, REINDEX, REUSE = "swa", "full", "reindex", "reuse"


@dataclass(frozen=True)
class LayerRole:
    layer: int
    mode: str                       # SWA / FULL / REINDEX / REUSE
    ratio: int                      # compression ratio m (0 = window only)
    kv_owner: Optional[int]         # layer whose compressed KV this layer reads
    topk_owner: Optional[int]       # layer whose indexer selection this layer uses
    owns_index_k: bool              # computes and stores index keys
    is_candidate_source: bool       # publishes the candidate pool
    uses_candidates: bool           # restricts its indexer to the pool
    engram_index: Optional[int]     # position in engram_layer_ids, None if no Engram
    is_dspark: bool                 # DSpark draft stage (slot >= num_hidden_layers)
    is_dspark_tap: bool             # the stream entering this layer feeds DSpark
    ced_role: str                   # "encoder", "decoder" or "draft"
    n_experts: int
    experts_per_tok: int

    @property
    def has_compressor(self) -> bool:
        return self.mode == FULL

    @property
    def has_indexer(self) -> bool:
        return self.mode in (FULL, REINDEX)


def _last_at_or_below(sources, layer: int) -> Optional[int]:
    below = [s for s in sources if s <= layer]
    return max(below) if below else None


def decoder_start(cfg: TextConfig) -> int:
    """First CED decoder layer: the ratio-1 kv source (20 = N/2 in the published config).

    The decoder's global KV is projected from the encoder output by that layer's compressor, so
    this, rather than N/2, is what makes CED prefill exact on configs with another split.
    """
    ones = [s for s in cfg.kv_source_layer_ids if cfg.compress_ratios[s] == 1]
    return min(ones) if ones else cfg.num_hidden_layers


def ced_halo(cfg: TextConfig, rows: int, rollback: int = 0) -> list:
    """(window-KV rows in, rows computed) of each decoder layer in an exact CED prefill of
    `rows` new positions (W + (D - 1)(W - 1) in and W + (D - 2)(W - 1) out at
    the first decoder layer, W - 1 fewer per layer, 1 out at the last). `rollback` > 1 adds
    rollback - 1 rows per layer, so the rings then hold what a trim of that many tokens needs
    (the minimal halo already allows 1)."""
    n, w = cfg.num_hidden_layers, cfg.sliding_window
    extra = max(0, rollback - 1)
    spans = []
    for layer in range(decoder_start(cfg), n):
        k = w + extra + (n - 1 - layer) * (w - 1)
        o = 1 if layer == n - 1 else w + extra + (n - 2 - layer) * (w - 1)
        spans.append((min(rows, k), min(rows, o)))
    return spans


def _role(cfg: TextConfig, layer: int) -> LayerRole:
    n = cfg.num_hidden_layers
    ratio = cfg.compress_ratios[layer]
    backbone = layer < n
    is_kv = backbone and layer in cfg.kv_source_layer_ids
    is_ix = backbone and layer in cfg.index_source_layer_ids
    if ratio == 0:
        mode = SWA
    else:
        mode = FULL if is_kv else (REINDEX if is_ix else REUSE)
    c = cfg.candidate_source_layer_id
    engram = cfg.engram_layer_ids.index(layer) if layer in cfg.engram_layer_ids else None
    if backbone:
        experts = (cfg.n_routed_experts, cfg.num_experts_per_tok)
        ced = "encoder" if layer < decoder_start(cfg) else "decoder"
    else:
        experts = (cfg.dspark_n_routed_experts or cfg.n_routed_experts,
                   cfg.dspark_num_experts_per_tok or cfg.num_experts_per_tok)
        ced = "draft"
    return LayerRole(
        layer=layer, mode=mode, ratio=ratio,
        kv_owner=_last_at_or_below(cfg.kv_source_layer_ids, layer) if ratio else None,
        topk_owner=_last_at_or_below(cfg.index_source_layer_ids, layer) if ratio else None,
        owns_index_k=is_ix and is_kv,
        is_candidate_source=backbone and layer == c,
        uses_candidates=is_ix and 0 <= c < layer,
        engram_index=engram,
        is_dspark=not backbone,
        is_dspark_tap=layer in cfg.dspark_target_layer_ids,
        ced_role=ced,
        n_experts=experts[0], experts_per_tok=experts[1],
    )


def layer_roles(cfg: TextConfig) -> tuple[LayerRole, ...]:
    """Roles of all `num_hidden_layers + num_nextn_predict_layers` slots."""
    return tuple(_role(cfg, layer) for layer in range(len(cfg.compress_ratios)))


def format_schedule(roles) -> str:
    """A fixed-width table of the schedule, one line per slot (used by mlx_v41.inspect)."""
    lines = ["slot  role     mode     ratio kv  topk  idx-k  cand     engram experts"]
    for r in roles:
        cand = "source" if r.is_candidate_source else ("pool" if r.uses_candidates else "-")
        lines.append(
            f"{r.layer:>4}  {r.ced_role:<8} {r.mode:<8} {r.ratio:>5} "
            f"{_dash(r.kv_owner):>3} {_dash(r.topk_owner):>5}  "
            f"{'yes' if r.owns_index_k else '-':<5}"
            f"  {cand:<8} {'yes' if r.engram_index is not None else '-':<6} "
            f"{r.n_experts}/{r.experts_per_tok}{'  tap' if r.is_dspark_tap else ''}")
    return "\n".join(lines)


def _dash(v) -> str:
    return "-" if v is None else str(v)
