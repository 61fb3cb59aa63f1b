"""Model configuration: the published Hugging Face `config.json`, one dataclass per section.

Field names equal the published keys (root, `text_config`, `vision_config`); defaults are the
published DeepSeek-V4.1-Flash values. `__post_init__` applies the load-time cross-field rules
and names the offending key when one fails.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

# Keys a config.json may omit: they carry no information the model needs.
OPTIONAL_TEXT_KEYS = {
    "attention_bias", "attention_dropout", "initializer_range", "use_cache", "hidden_act",
    "tie_word_embeddings", "topk_method", "model_type", "norm_topk_prob", "scoring_func",
    "max_position_embeddings",
}


POSITIVE_TEXT_KEYS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
    "q_lora_rank", "o_lora_rank", "o_groups", "moe_intermediate_size", "n_routed_experts",
    "num_experts_per_tok", "sliding_window", "candidate_topk_blocks", "candidate_block_size",
    "index_n_heads", "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters",
    "max_position_embeddings")
ROPE_SCALING_KEYS = ("factor", "beta_fast", "beta_slow", "original_max_position_embeddings")
# Root keys a config.json may carry that describe the file, not the model (`model_file`:
# the entry module mlx-lm loads a converted folder through): no warning.
IGNORED_ROOT_KEYS = {"transformers_version", "model_file"}
# Sparse-attention knobs a load may override (`with_overrides`): none changes a weight's shape.
# The window only shrinks: the weights were trained with the checkpoint's.
OVERRIDE_KEYS = ("index_topk", "candidate_topk_blocks", "sliding_window")


class ConfigError(ValueError):
    """A config.json value is missing or inconsistent; the message names the key."""


class ConfigWarning(UserWarning):
    """config.json has keys no field reads (a misspelled optional key gives its default)."""


def _check_types(obj, section: str) -> None:
    """Every field must have the type of its published default (ints for sizes, lists of
    ints for layer lists), so that a quoted number fails here and not deep in the model."""
    for f in dataclasses.fields(obj):
        value, default = getattr(obj, f.name), _default(f)
        if default is None:
            continue
        ok = _same_kind(value, default)
        if ok and isinstance(default, list) and default and isinstance(default[0], int):
            ok = all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        if not ok:
            raise ConfigError(f"{section}.{f.name}: expected {type(default).__name__}, got "
                              f"{value!r}")


def _default(f):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _same_kind(value, default) -> bool:
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, type(default))


@dataclass
class TextConfig:
    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_nextn_predict_layers: int = 3
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_lora_rank: int = 1024
    o_groups: int = 8
    moe_intermediate_size: int = 2304
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-20
    attention_bias: bool = False
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    use_cache: bool = True
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=lambda: {
        "rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
        "original_max_position_embeddings": 65536})
    compress_rope_theta: float = 160000.0
    sliding_window: int = 128
    compress_ratios: list = field(default_factory=lambda: [0, 0] + [2] * 18 + [1] * 20 + [0] * 3)
    kv_source_layer_ids: list = field(default_factory=lambda: [2, 8, 14, 20])
    index_source_layer_ids: list = field(
        default_factory=lambda: [2, 8, 14, 20, 24, 28, 32, 36])
    candidate_source_layer_id: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram_layer_ids: list = field(default_factory=lambda: [1, 14])
    engram_num_embeddings: list = field(default_factory=lambda: [384006168, 384016682])
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16000000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 99092
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: list = field(default_factory=lambda: [37, 38, 39])
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    model_type: str = "deepseek_v41_text"

    def __post_init__(self):
        _check_types(self, "text_config")
        for key in POSITIVE_TEXT_KEYS:
            if getattr(self, key) <= 0:
                self._fail(key, "must be positive")
        missing = [k for k in ROPE_SCALING_KEYS if k not in self.rope_scaling]
        if missing:
            raise ConfigError(f"text_config.rope_scaling: missing key {missing[0]!r}")
        self._check_shapes()
        self._check_schedule()
        self._check_sources()

    def _fail(self, key: str, why: str):
        raise ConfigError(f"text_config.{key}: {why} (got {getattr(self, key)!r})")

    def _check_shapes(self):
        if self.n_shared_experts != 1:
            self._fail("n_shared_experts", "must be 1")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.head_dim:
            self._fail("qk_rope_head_dim", f"must be even and <= head_dim {self.head_dim}")
        if self.qk_rope_head_dim > self.index_head_dim:
            self._fail("qk_rope_head_dim", f"must be <= index_head_dim {self.index_head_dim}")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            self._fail("o_groups", "must divide num_attention_heads * head_dim")
        if self.num_attention_heads % self.o_groups:
            self._fail("o_groups", "must divide num_attention_heads")
        if self.num_experts_per_tok > self.n_routed_experts:
            self._fail("num_experts_per_tok", "exceeds n_routed_experts")
        if self.scoring_func != "sqrtsoftplus":
            self._fail("scoring_func", "only 'sqrtsoftplus' is defined for V4.1")
        for key in ("hidden_size", "head_dim", "index_head_dim", "q_lora_rank",
                    "moe_intermediate_size"):
            if getattr(self, key) % 32:
                self._fail(key, "must be a multiple of 32 (FP8/FP4 block size)")
        if self.head_dim % 16:
            self._fail("head_dim", "must be a multiple of 16")

    def _check_schedule(self):
        n, mtp = self.num_hidden_layers, self.num_nextn_predict_layers
        ratios = self.compress_ratios
        if len(ratios) != n + mtp:
            self._fail("compress_ratios", f"needs num_hidden_layers + num_nextn_predict_layers"
                       f" = {n + mtp} entries, has {len(ratios)}")
        if any(r not in (0, 1, 2) for r in ratios):
            self._fail("compress_ratios", "entries must be 0, 1 or 2")
        if any(ratios[n:]):
            self._fail("compress_ratios", "DSpark slots must have ratio 0")
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            self._fail("engram_num_embeddings", "needs one entry per engram layer")
        if any(not 0 <= layer < n for layer in self.engram_layer_ids):
            self._fail("engram_layer_ids", f"layers must lie in 0..{n - 1}")
        if any(not 0 <= layer < n for layer in self.dspark_target_layer_ids):
            self._fail("dspark_target_layer_ids", f"layers must lie in 0..{n - 1}")

    def _check_sources(self):
        n, ratios = self.num_hidden_layers, self.compress_ratios
        kv, ix = self.kv_source_layer_ids, self.index_source_layer_ids
        for s in kv:
            if not 0 <= s < n or ratios[s] == 0:
                self._fail("kv_source_layer_ids",
                           f"layer {s} is not a backbone layer with ratio > 0")
            if s not in ix:
                self._fail("index_source_layer_ids", f"kv source {s} must also be an index source")
        for layer in range(n):
            if ratios[layer] == 0:
                continue
            owners = [s for s in kv if s <= layer]
            if not owners or ratios[max(owners)] != ratios[layer]:
                self._fail("kv_source_layer_ids",
                           f"layer {layer} (ratio {ratios[layer]}) has no kv source of its ratio")
            if max(s for s in ix if s <= layer) < max(owners):
                self._fail("index_source_layer_ids", f"layer {layer} selects against stale KV")
        c = self.candidate_source_layer_id
        if c >= 0 and (c not in kv or ratios[c] != 1):
            self._fail("candidate_source_layer_id", "must be a ratio-1 kv source or -1")
        for layer in ix:
            if 0 <= c < layer < n and max(s for s in kv if s <= layer) != c:
                self._fail("kv_source_layer_ids", f"layer {layer} uses the candidate pool of "
                           f"layer {c} but reads another layer's KV")


@dataclass
class VisionConfig:
    num_hidden_layers: int = 32
    hidden_size: int = 1024
    num_attention_heads: int = 16
    intermediate_size: int = 2816
    patch_size: int = 14
    rope_theta: float = 10000.0
    downsample_ratio: int = 3
    max_image_tokens: int = 1024
    min_pixels: int = 295936
    max_wh_ratio: Optional[float] = None
    model_type: str = "deepseek_v41_vision"


@dataclass
class ModelArgs:
    """The root `config.json`: top-level ids plus the nested text and vision sections."""

    architectures: list = field(default_factory=lambda: ["DeepseekV41ForCausalLM"])
    model_type: str = "deepseek_v41"
    dtype: str = "bfloat16"
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    image_token_id: int = 129264
    quantization_config: dict = field(default_factory=lambda: {
        "activation_scheme": "dynamic", "expert_dtype": "fp4", "quant_method": "fp8",
        "scale_fmt": "ue8m0", "weight_block_size": [32, 32]})
    # Written by mlx_v41.convert for requantized models, in mlx-lm's form.
    quantization: Optional[dict] = None
    text_config: TextConfig = field(default_factory=TextConfig)
    vision_config: VisionConfig = field(default_factory=VisionConfig)

    def __post_init__(self):
        _check_types(self, "config")
        if self.model_type != "deepseek_v41":
            raise ConfigError(f"model_type: expected 'deepseek_v41', got {self.model_type!r}")
        if self.quantization_config and self.quantization_config.get(
                "weight_block_size", [32, 32]) != [32, 32]:
            raise ConfigError("quantization_config.weight_block_size: only [32, 32] is supported")

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config.json") -> "ModelArgs":
        if "text_config" not in data:
            raise ConfigError(f"{source}: missing key 'text_config' (expected the published"
                              " Hugging Face layout)")
        text = _section(TextConfig, data["text_config"], "text_config", source, OPTIONAL_TEXT_KEYS)
        vision = _section(VisionConfig, data.get("vision_config") or {}, "vision_config",
                          source, None)
        root = {k: v for k, v in data.items() if k in _field_names(cls)
                and k not in ("text_config", "vision_config")}
        _warn_unknown(data, source)
        return cls(**root, text_config=text, vision_config=vision)

    @classmethod
    def from_file(cls, path) -> "ModelArgs":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: file not found") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(data, str(path))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def with_overrides(args: ModelArgs, overrides: Optional[dict]) -> ModelArgs:
    """`args` with load-time values of the sparse-attention knobs (`OVERRIDE_KEYS`); a
    ConfigError naming the key for an unknown key or a value the weights cannot honour."""
    if not overrides:
        return args
    if not isinstance(overrides, dict):
        raise ConfigError(f"overrides: expected a dict of {', '.join(OVERRIDE_KEYS)}, got "
                          f"{type(overrides).__name__}")
    text = args.text_config
    for key, value in overrides.items():
        _check_override(text, key, value)
    return dataclasses.replace(args, text_config=dataclasses.replace(text, **overrides))


def _check_override(text: TextConfig, key: str, value) -> None:
    if key not in OVERRIDE_KEYS:
        raise ConfigError(f"overrides.{key}: not a load-time override (one of "
                          f"{', '.join(OVERRIDE_KEYS)})")
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"overrides.{key}: expected an integer, got {value!r}")
    if value < 1:
        raise ConfigError(f"overrides.{key}: must be >= 1 (got {value})")
    most, why = override_limit(text, key)
    if value > most:
        raise ConfigError(f"overrides.{key}: {value} exceeds {most}, {why}")


def override_limit(text: TextConfig, key: str) -> tuple:
    """(largest value, the reason) an override of `key` may take with this checkpoint."""
    if key == "sliding_window":
        return text.sliding_window, ("the checkpoint's window: its weights were made with it, "
                                     "so only a smaller window can be used")
    ratios = [r for r in text.compress_ratios[:text.num_hidden_layers] if r > 0] or [1]
    rows = text.max_position_embeddings // min(ratios)
    if key == "index_topk":
        return rows, "the most compressed rows a query can see (max_position_embeddings / " \
            "the smallest compress ratio)"
    return -(-rows // text.candidate_block_size), ("the most candidate blocks of "
                                                  f"{text.candidate_block_size} rows a query "
                                                  "can see")


def _field_names(cls) -> set:
    return {f.name for f in dataclasses.fields(cls)}


def _warn_unknown(data: dict, source: str) -> None:
    """One warning per load listing every key no field reads, as `section.key`."""
    unknown = sorted(set(data) - _field_names(ModelArgs) - IGNORED_ROOT_KEYS)
    for name, cls in (("text_config", TextConfig), ("vision_config", VisionConfig)):
        section = data.get(name) or {}
        unknown += sorted(f"{name}.{k}" for k in set(section) - _field_names(cls))
    if unknown:
        warnings.warn(f"{source}: ignoring unknown keys {', '.join(unknown)} (misspelled? "
                      "their defaults are used)", ConfigWarning, stacklevel=3)


def _section(cls, data: dict, name: str, source: str, optional: Optional[set]):
    """Build a section dataclass; with `optional` given, every other field is required."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: {name} must be an object, got {type(data).__name__}")
    names = _field_names(cls)
    if optional is not None:
        missing = sorted(names - set(data) - optional)
        if missing:
            raise ConfigError(f"{source}: missing key {name}.{missing[0]}")
    return cls(**{k: v for k, v in data.items() if k in names})


def official_config_path() -> Path:
    """The published config.json shipped as package data."""
    return Path(__file__).parent / "configs" / "config.json"
