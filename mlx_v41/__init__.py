"""mlx_v41: DeepSeek V4.1 Flash in MLX.

Public API: `load_model(path)` -> Model; `model.make_cache()`; `model(ids, cache=cache)`.
Generation (mlx-lm's conventions): `load(path_or_repo)` -> (model, tokenizer); `generate`,
`stream_generate`; many sequences at once: `batch_generate`, `BatchGenerator` (continuous
batching, each sequence exact as at batch 1). Prompt caches: `trim_cache`,
`save_prompt_cache`, `load_prompt_cache`.
"""

from __future__ import annotations

from .cache import (CacheError, cache_bytes, copy_cache, load_prompt_cache, save_prompt_cache,
                    trim_cache)
from .checkpoint.load import load_model
from .errors import CheckpointError
from .checkpoint.source import load
from .generation.api import generate, stream_generate
from .generation.batch import BatchGenerator
from .generation.batch_generate import batch_generate
from .generation.speculative import Sampling
from .model.config import ConfigError, ConfigWarning, ModelArgs

__version__ = "0.1.0"

__all__ = ["load", "generate", "stream_generate", "batch_generate", "BatchGenerator",
           "Sampling",
           "load_model", "ModelArgs", "ConfigError", "ConfigWarning", "CheckpointError",
           "CacheError",
           "cache_bytes", "trim_cache", "save_prompt_cache", "load_prompt_cache", "copy_cache"]
