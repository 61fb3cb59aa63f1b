"""mlx_v41.convert: the published DeepSeek V4.1 Flash checkpoint to an MLX model folder.

Streaming (one tensor at a time), resumable (finished files verified by size + sha256),
atomic (a temporary sibling folder renamed into place), with the official precision repacked
bit-exactly by default, mlx-lm style requantization recipes, and memory-mapped Engram tables.

    mlx_v41.convert --hf-path deepseek-ai/DeepSeek-V4.1-Flash --mlx-path v41-mlx
    python -m mlx_v41.convert --hf-path ./hf --mlx-path ./v41-3bit --quant-predicate mixed_3_8
"""

from .pipeline import DEFAULT_SHARD_SIZE, convert
from .recipes import PRESETS
from .source import ConvertError

__all__ = ["convert", "ConvertError", "PRESETS", "DEFAULT_SHARD_SIZE"]
