"""What Ollama's `/api/tags`, `/api/show`, `/api/ps` and `/api/version` say of the served model:
its name as Ollama spells it (`name:latest`), the details Ollama clients read (family,
parameter count, quantization, context length), taken from the config and the layout of the
weights it implies, and those routes' reply bodies.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

from mlx.utils import tree_flatten
from mlx_lm.utils import get_total_parameters
from pydantic import BaseModel

from ...model.layers import configure_quantization
from ...model.memory import resident_bytes
from ...model.model import Model
from ...model.vision.prompt import has_vision

# The Ollama release whose API these routes follow (its docs/api.md); clients compare the
# version against the minimum they need.
OLLAMA_VERSION = "0.32.15"
LATEST = ":latest"  # Ollama's default tag
NEVER = "9999-12-31T23:59:59Z"  # `expires_at` of a model held until the server stops
WEIGHTS_FORMAT = "safetensors"  # MLX's weights (Ollama's own are "gguf")
DTYPE_NAMES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
CAPABILITIES = ["completion", "tools", "thinking"]  # and "vision" with the vision tower


def timestamp(moment: Optional[datetime] = None) -> str:
    """RFC 3339 in UTC, as Ollama writes `created_at`."""
    moment = moment or datetime.now(timezone.utc)
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")


def ollama_name(model_id: str) -> str:
    """The served model's name in Ollama's listings: its folder's name with the default tag."""
    return Path(model_id).name + LATEST


def plain_name(name: str) -> str:
    """A requested name without Ollama's default tag (the names `ServerConfig.check_model`
    takes)."""
    return name.removesuffix(LATEST)


def parameter_size(count: int) -> str:
    """Ollama's spelling of a parameter count: 7.6B, 284M, 12K."""
    for scale, unit in ((10**9, "B"), (10**6, "M"), (10**3, "K")):
        if count >= scale:
            return f"{count / scale:.1f}{unit}"
    return str(count)


def quantization_level(args) -> str:
    """The weights' layout: mlx-lm's `quantization` (Q4, MXFP4, ...), else the published
    one (FP8 with FP4 experts), else the dtype."""
    if args.quantization:
        mode = args.quantization.get("mode", "affine")
        bits = args.quantization.get("bits")
        return f"Q{bits}" if mode == "affine" else str(mode).upper()
    config = args.quantization_config
    if config:
        return f"{config.get('quant_method', '').upper()}/{config.get('expert_dtype', '').upper()}"
    return DTYPE_NAMES.get(args.dtype, args.dtype.upper())


@dataclass(frozen=True)
class Description:
    """The served model as Ollama's listings describe it (`describe`)."""

    name: str
    details: dict
    parameters: int
    size: int  # bytes of the weights the config lays out (the backbone, as loaded)
    resident: int  # bytes the loaded model holds in memory
    context_length: int
    digest: str
    modified_at: str
    capabilities: list
    model_info: dict

    def entry(self) -> dict:
        """An `/api/tags` entry."""
        return {"name": self.name, "model": self.name, "modified_at": self.modified_at,
                "size": self.size, "digest": self.digest, "details": self.details}

    def running(self) -> dict:
        """An `/api/ps` entry: held in (unified) memory until the server stops."""
        return {"name": self.name, "model": self.name, "size": self.resident,
                "digest": self.digest, "details": self.details, "expires_at": NEVER,
                "size_vram": self.resident, "context_length": self.context_length}


def describe(model, model_id: str, loaded_at: datetime) -> Description:
    """The description of `model` (loaded as `model_id` at `loaded_at`). The parameter count
    and size come from a lazy model of its config (nothing is allocated), so experts streamed
    from disk count too."""
    args, text = model.args, model.args.text_config
    layout = Model(args)
    if args.quantization:
        configure_quantization(layout, args.quantization)
    parameters = get_total_parameters(layout)
    family = args.model_type
    details = {"parent_model": "", "format": WEIGHTS_FORMAT, "family": family,
               "families": [family], "parameter_size": parameter_size(parameters),
               "quantization_level": quantization_level(args)}
    info = {"general.architecture": family, "general.basename": Path(model_id).name,
            "general.parameter_count": parameters,
            f"{family}.context_length": text.max_position_embeddings,
            f"{family}.embedding_length": text.hidden_size,
            f"{family}.block_count": text.num_hidden_layers,
            f"{family}.attention.head_count": text.num_attention_heads,
            f"{family}.expert_count": text.n_routed_experts,
            f"{family}.expert_used_count": text.num_experts_per_tok,
            f"{family}.vocab_size": text.vocab_size}
    config = json.dumps(args.to_dict(), sort_keys=True, default=str)
    return Description(
        ollama_name(model_id), details, parameters, _nbytes(layout), resident_bytes(model),
        text.max_position_embeddings, hashlib.sha256(config.encode()).hexdigest(),
        timestamp(loaded_at), CAPABILITIES + (["vision"] if has_vision(model) else []), info)


def _nbytes(model) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def show_parameters(config) -> str:
    """`/api/show`'s `parameters`: the server's defaults, one `name value` a line as in a
    Modelfile."""
    values = {"temperature": config.temp, "top_p": config.top_p, "top_k": config.top_k,
              "min_p": config.min_p, "num_predict": config.max_tokens}
    return "\n".join(f"{name:<30} {value}" for name, value in values.items())


# ----------------------------------------------------------------------------- replies

class ModelDetails(BaseModel):
    parent_model: str
    format: str
    family: str
    families: list[str]
    parameter_size: str
    quantization_level: str


class ModelEntry(BaseModel):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: ModelDetails


class TagList(BaseModel):
    """`GET /api/tags`: the one model this server serves."""

    models: list[ModelEntry]


class RunningModel(BaseModel):
    name: str
    model: str
    size: int
    digest: str
    details: ModelDetails
    expires_at: str
    size_vram: int
    context_length: int


class RunningList(BaseModel):
    """`GET /api/ps`: the served model, loaded while the server runs."""

    models: list[RunningModel]


class ShowResponse(BaseModel):
    """`POST /api/show`."""

    parameters: str
    details: ModelDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class Version(BaseModel):
    version: str
