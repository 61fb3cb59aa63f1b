"""What a config implies in bytes: the length-dependent global KV per token, the constant
per-sequence state, one session's cache, and the weights as this package holds them. From
the config (head and index widths, ratios, owner layers) and the packed record formats of
`mlx_v41.cache`, not from tabulated constants; per conversion recipe, the weights split into
the routed experts (which can stream from SSD) and the rest. `mlx_v41.inspect` prints them;
the server admits sessions by them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from mlx.utils import tree_flatten

from ..cache.layer import RING_FACTOR
from .config import ModelArgs, TextConfig
from .layers import allocate_quantized, configure_quantization, input_dims
from .moe import MoE, SwitchMLP
from .schedule import FULL, layer_roles

FP32_BYTES = 4
# The converter's mixed presets (`mlx_v41.convert --quant-predicate mixed_E_8`): routed experts
# requantized to affine E bits in groups of 64 (bf16 scales and biases), the rest as published.
PRESET_EXPERT_BITS = {"mixed_4_8": 4, "mixed_3_8": 3, "mixed_2_8": 2}
PRESET_GROUP_SIZE = 64
RECIPES = ("official", *PRESET_EXPERT_BITS)
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def resident_bytes(model) -> int:
    """Bytes a loaded model holds: its parameters, plus the streamed experts' slots (their
    tables on disk are not counted)."""
    store = getattr(model, "expert_store", None)
    return sum(v.nbytes for _, v in tree_flatten(model.parameters())) + \
        (0 if store is None else store.nbytes)


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
    sizes = recipe_bytes(args)
    return sizes.resident + sizes.experts, sizes.tables


@dataclass(frozen=True)
class RecipeBytes:
    """The weights of one recipe as this package holds them (the text model, without the
    DSpark drafter and the vision tower), split as a streamed load splits them."""

    name: str
    resident: int   # every weight but the routed experts
    experts: int    # every routed expert
    expert: int     # one routed expert: its 3 projections' packed weight, scales (and biases)
    minimum: int    # the smallest expert budget that runs: one expert of each layout
    decode: int     # routed-expert bytes one decode token reads: top-k in every MoE layer
    tables: int     # Engram tables, memory-mapped

    def token_bytes(self, hit_rate: float) -> float:
        """Bytes read from SSD per decode token when `hit_rate` of its experts are held."""
        return self.decode * (1 - hit_rate)


def recipe_bytes(args: ModelArgs, recipe: str = "official",
                 quantization: Optional[dict] = None) -> RecipeBytes:
    """`RecipeBytes` of a preset in `RECIPES`, or, with an mlx-lm `quantization` block (a
    converted config's), of that layout under the name `recipe`."""
    from .model import Model

    model = Model(args)  # parameters stay lazy: nothing is allocated
    if quantization is not None:
        configure_quantization(model, quantization)
    elif recipe in PRESET_EXPERT_BITS:
        requantize_experts(model, PRESET_EXPERT_BITS[recipe])
    elif recipe != "official":
        raise ValueError(f"recipe must be one of {', '.join(RECIPES)}, got {recipe!r}")
    return measure_weights(model, recipe)


def requantize_experts(model, bits: int) -> None:
    """Lay out every routed expert of a lazy `model` as a preset does (a projection whose
    input width is not a multiple of the group stays as published, as the converter keeps it)."""
    for _, module in model.named_modules():
        if type(module) is not SwitchMLP:
            continue
        for proj in PROJECTIONS:
            lin = getattr(module, proj)
            if input_dims(lin) % PRESET_GROUP_SIZE == 0:
                *lead, output_dims, _ = lin.weight.shape
                allocate_quantized(lin, tuple(lead), output_dims, input_dims(lin), "affine",
                                   bits, PRESET_GROUP_SIZE)


def measure_weights(model, name: str = "this model") -> RecipeBytes:
    """`RecipeBytes` of a built (possibly lazy, not yet loaded) `model` as it is laid out."""
    from .engram import EngramTable

    total = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    moes = [m for _, m in model.named_modules() if isinstance(m, MoE)]
    layouts, experts, decode = {}, 0, 0
    for moe in moes:
        switch = moe.experts.switch_mlp
        each = sum(v.nbytes for _, v in tree_flatten(switch.parameters())) // switch.n_experts
        layouts[_layout(switch)] = each
        experts += each * switch.n_experts
        decode += each * moe.gate.top_k
    tables = sum(m.nbytes for _, m in model.named_modules() if isinstance(m, EngramTable))
    return RecipeBytes(name, total - experts, experts, max(layouts.values(), default=0),
                       sum(layouts.values()), decode, tables)


def _layout(switch: SwitchMLP) -> tuple:
    return tuple((lin.mode, lin.bits, lin.group_size, lin.weight.shape[1:])
                 for lin in (getattr(switch, p) for p in PROJECTIONS))
