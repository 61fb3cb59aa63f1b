"""mlx_v41: DeepSeek V4.1 Flash in MLX.

Public API: `load_model(path)` -> Model; `model.make_cache()`; `model(ids, cache=cache)`.
Generation (mlx-lm's conventions): `load(path_or_repo)` -> (model, tokenizer); `generate`,
`stream_generate`. Prompt caches: `trim_cache`, `save_prompt_cache`, `load_prompt_cache`.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

from .cache import (CacheError, cache_bytes, copy_cache, load_prompt_cache, save_prompt_cache,
                    trim_cache)
from .checkpoint.load import load_model
from .checkpoint.safetensors_io import CheckpointError
from .model.config import ConfigError, ConfigWarning, ModelArgs

__version__ = "0.1.0"


class _CheckoutConverter:
    """Import finder for a source checkout that is not installed: the converter lives in
    ../convert (installed as mlx_v41.convert), so map that name to it. Consulted only after
    the normal finders fail, so an installed package always wins."""

    folder = Path(__file__).resolve().parent.parent / "convert"

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname != f"{__name__}.convert" or not (cls.folder / "__init__.py").is_file():
            return None
        import importlib.util

        return importlib.util.spec_from_file_location(
            fullname, cls.folder / "__init__.py", submodule_search_locations=[str(cls.folder)])


if not any(f is _CheckoutConverter for f in sys.meta_path):
    sys.meta_path.append(_CheckoutConverter)


# `python -m mlx_v41.generate` imports the module `mlx_v41.generate` although the package
# exports the function of that name (as mlx-lm does); runpy's warning about that is harmless.
warnings.filterwarnings("ignore", category=RuntimeWarning,
                        message=r"'mlx_v41\.generate' found in sys\.modules")
from .checkpoint.source import load  # noqa: E402
from .generation.api import generate, stream_generate  # noqa: E402
from .generation.speculative import Sampling  # noqa: E402

__all__ = ["load", "generate", "stream_generate", "Sampling",
           "load_model", "ModelArgs", "ConfigError", "ConfigWarning", "CheckpointError", "CacheError",
           "cache_bytes", "trim_cache", "save_prompt_cache", "load_prompt_cache", "copy_cache"]
