"""Random checkpoints for tests and benchmarks, in the published layout.

`mlx_v41.checkpoint.random_checkpoint` holds what the demo needs (the tiny config, the tensor
catalogue, the writers). This module adds the options only tests and benchmarks use: the
reference's `schedule` config, checkpoints without Engram, other shard counts, edited or missing
tensors, tokenizer files copied from another folder or a synthetic Engram token map. A 512-token
vocabulary gets the tiny golden's tokenizer files (so its Engram token map matches the goldens').
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from mlx_v41.checkpoint.random_checkpoint import (Tensor, checkpoint_groups, root_config,
                                                  sized_text_config, tiny_text_config,
                                                  write_shards)

GOLDENS = Path(__file__).parent / "data" / "goldens"
TINY_HF = GOLDENS / "tiny" / "hf"
TOKENIZER_VOCAB = 512  # vocabulary of the goldens' synthetic tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "engram_token_map.json")

# The reference's `schedule` checkpoint: the published 40 + 3 layer schedule at the tiny widths.
SCHEDULE_OVERRIDES = {
    "candidate_block_size": 8, "candidate_source_layer_id": 20,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
    "dspark_target_layer_ids": [37, 38, 39], "engram_layer_ids": [1, 14],
    "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36], "index_topk": 32,
    "kv_source_layer_ids": [2, 8, 14, 20], "moe_intermediate_size": 32, "n_routed_experts": 6,
    "num_experts_per_tok": 3, "num_hidden_layers": 40,
}


def schedule_text_config(**overrides) -> dict:
    """The schedule text_config: the published 40 + 3 layer schedule at hidden 128."""
    return tiny_text_config(**SCHEDULE_OVERRIDES, **overrides)


def without_engram(text_config: dict) -> dict:
    """The same config with no Engram layers (what mlx-lm's port accepts)."""
    return {**text_config, "engram_layer_ids": [], "engram_num_embeddings": []}


def _shard_plan(groups: list, shard_count: Optional[int]) -> list[dict[str, Tensor]]:
    """Published layout: one shard per group; otherwise contiguous runs of groups."""
    if shard_count is None or shard_count == len(groups):
        return groups
    if not 1 <= shard_count <= len(groups):
        raise ValueError(f"shard_count must lie in 1..{len(groups)}, got {shard_count}")
    bounds = np.linspace(0, len(groups), shard_count + 1).round().astype(int)
    return [{k: v for grp in groups[a:b] for k, v in grp.items()}
            for a, b in zip(bounds[:-1], bounds[1:])]


def _copy_tokenizer(tokenizer_dir, folder: Path) -> None:
    if tokenizer_dir is not None and Path(tokenizer_dir).resolve() != folder.resolve():
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copyfile(Path(tokenizer_dir) / name, folder / name)


def _write_synthetic_token_map(folder: Path, cfg: dict, seed: int) -> None:
    """engram_token_map.json (token id -> compressed id, every compressed id used) for a
    checkpoint without a tokenizer."""
    vocab, compressed = cfg["vocab_size"], cfg["engram_compressed_vocab_size"]
    if compressed > vocab:
        raise ValueError("engram_compressed_vocab_size exceeds vocab_size")
    rng = np.random.default_rng([seed, vocab])
    mapping = np.concatenate([np.arange(compressed), rng.integers(0, compressed,
                                                                  vocab - compressed)])
    (folder / "engram_token_map.json").write_text(json.dumps(mapping.tolist()))


def write_checkpoint(folder, text_config: Optional[dict] = None, *, seed: int = 0,
                     engram: bool = True, shard_count: Optional[int] = None,
                     edit: Optional[Callable[[str, Tensor], Optional[Tensor]]] = None,
                     tokenizer_dir=None) -> Path:
    """Write a random checkpoint in the published Hugging Face layout.

    Args:
        folder: output folder (created; existing files with the same names are overwritten).
        text_config: the `text_config` section (default: `tiny_text_config()`); with Engram on,
            `engram_num_embeddings` is recomputed from the primes.
        seed: random seed; each tensor's values depend only on (seed, its name).
        engram: False drops the Engram layers (config and tensors).
        shard_count: None for the published grouping (vision, embed, one per layer, head,
            one per DSpark stage, one per Engram layer); else that many shards.
        edit: called as edit(name, tensor) before writing; return a replacement, or None to
            leave the tensor out (for bad-input tests).
        tokenizer_dir: a folder whose tokenizer.json / tokenizer_config.json /
            engram_token_map.json are copied (it may be `folder` itself); default the tiny
            golden's for a 512-token vocabulary. With Engram on, `engram_compressed_vocab_size`
            then comes from its tokenizer.json; without one, the checkpoint gets a synthetic
            engram_token_map.json.
    Returns:
        The folder.
    """
    cfg = dict(text_config or tiny_text_config())
    if tokenizer_dir is None and cfg["vocab_size"] == TOKENIZER_VOCAB:
        tokenizer_dir = TINY_HF
    if not engram:
        cfg = without_engram(cfg)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _copy_tokenizer(tokenizer_dir, folder)
    tokenizer = folder / "tokenizer.json"
    if not tokenizer.is_file():
        tokenizer = None
        if cfg["engram_layer_ids"]:
            _write_synthetic_token_map(folder, cfg, seed)
    config = root_config(sized_text_config(cfg, tokenizer))
    shards = _shard_plan(checkpoint_groups(config, seed), shard_count)
    if edit is not None:
        shards = [{k: t for k, t in ((k, edit(k, v)) for k, v in s.items()) if t is not None}
                  for s in shards]
    return write_shards(folder, shards, config)
