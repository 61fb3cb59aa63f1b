"""mlx_v41: DeepSeek V4.1 Flash in MLX.

Public API: `load_model(path)` -> Model; `model.make_cache()`; `model(ids, cache=cache)`.
"""

from __future__ import annotations

from pathlib import Path

from .cache import CacheError, cache_bytes, trim_cache
from .config import ConfigError, ModelArgs
from .prompt_cache import copy_cache, load_prompt_cache, save_prompt_cache
from .safetensors_io import CheckpointError

__version__ = "0.1.0"


def _token_map(folder: Path, cfg):
    from .engram_hash import build_token_map, load_token_map
    import json
    import numpy as np

    tokenizer = folder / "tokenizer.json"
    if tokenizer.is_file():
        try:
            return load_token_map(tokenizer,
                                  compressed_vocab_size=cfg.engram_compressed_vocab_size)
        except Exception as e:  # the tokenizers library raises a bare Exception on bad JSON
            message = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CheckpointError(f"{tokenizer}: {message}") from None
    mapping = folder / "engram_token_map.json"
    if mapping.is_file():
        return np.array(json.loads(mapping.read_text()), dtype=np.int32)
    raise CheckpointError(f"{folder}: the Engram token map needs tokenizer.json (or "
                          "engram_token_map.json)")


def load_model(path, compat_reference_index_k_bug: bool = False, prefill_mode: str = "ced"):
    """Load a model folder in the published Hugging Face layout.

    Args:
        path: folder with config.json, model.safetensors.index.json and the shards.
        compat_reference_index_k_bug: reproduce the reference's decode-time index-key defect
            (spec deviations.md D1); only for parity tests against the reference.
        prefill_mode: "ced" (default: exact encoder-only prefill with the decoder halo),
            "full" (every layer over every row, like the reference) or "ced_replay" (the tech
            report's bounded replay: APPROXIMATE, opt-in).
    Returns:
        The `Model`, weights loaded and evaluated.
    """
    from .engram_hash import EngramHasher
    from .loader import load_weights
    from .model import Model

    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: model folder not found")
    args = ModelArgs.from_file(folder / "config.json")
    model = Model(args, compat_reference_index_k_bug=compat_reference_index_k_bug,
                  prefill_mode=prefill_mode)
    load_weights(model, folder)
    if args.text_config.engram_layer_ids:
        model.engram_hasher = EngramHasher.from_config(
            args.text_config, _token_map(folder, args.text_config))
    return model


__all__ = ["load_model", "ModelArgs", "ConfigError", "CheckpointError", "CacheError",
           "cache_bytes", "trim_cache", "save_prompt_cache", "load_prompt_cache", "copy_cache"]
