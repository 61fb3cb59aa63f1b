"""`load_model(path)`: a `Model` from a folder in the published layout or one written by
`mlx_v41.convert`, with its Engram token map.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Optional

from ..cache.layer import rollback_limit
from ..model.config import ConfigError, ModelArgs, with_overrides
from ..errors import CheckpointError

if TYPE_CHECKING:
    from .placement import Placement

# Payload bytes hashed at each end of a published shard: other values under the same header
# (another seed or fine-tune of one config) change them, and reading them costs nothing.
SAMPLE_BYTES = 1 << 16


def _token_map(folder: Path, cfg):
    from ..model.engram_hash import load_token_map
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


def weights_fingerprint(folder: Path) -> str:
    """sha256 naming a checkpoint's weights, cheap at any size: a converted folder's manifest
    file list (size and sha256 of every file), or every published shard's header and the first
    and last `SAMPLE_BYTES` of its payload. Prompt caches record it."""
    from .converted import is_converted, read_manifest
    from .loader import read_index

    digest = hashlib.sha256()
    if is_converted(folder):
        digest.update(json.dumps(read_manifest(folder)["files"], sort_keys=True).encode())
        return digest.hexdigest()
    for shard in sorted(set(read_index(folder).values())):
        digest.update(shard.name.encode())
        _hash_shard(digest, shard)
    return digest.hexdigest()


def _hash_shard(digest, path: Path) -> None:
    from .loader import data_start

    start, size = data_start(path), path.stat().st_size
    with open(path, "rb") as f:
        digest.update(f.read(start + SAMPLE_BYTES))  # the length, the header, the payload's start
        f.seek(max(start, size - SAMPLE_BYTES))
        digest.update(f.read())


def _holds(folder, group: str, converted_entry) -> bool:
    """Whether a model folder holds the tensors of the loader's `group`: a published folder's
    index names them; a converted folder's manifest says so (`converted_entry(manifest)`)."""
    from .converted import is_converted, read_manifest
    from .loader import has_group, read_index

    folder = Path(folder)
    if is_converted(folder):
        return bool(converted_entry(read_manifest(folder)))
    return has_group(read_index(folder), group)


def has_drafter(folder) -> bool:
    """Whether a model folder holds the DSpark drafter (published `mtp.*` tensors, or the
    `dspark-*` files of a converted folder)."""
    return _holds(folder, "dspark", lambda manifest: manifest.get("dspark"))


def has_vision_tower(folder) -> bool:
    """Whether a model folder holds the vision tower (a converted folder: in its extras)."""
    return _holds(folder, "vision", lambda manifest: manifest.get("extras", {}).get("vision"))


def _drafts_fit(cfg) -> bool:
    """Whether the window rings can undo a rejected DSpark block (a smaller window override
    shrinks them)."""
    return rollback_limit(cfg.sliding_window) >= cfg.dspark_block_size


def load_model(path, compat_reference_index_k_bug: bool = False, prefill_mode: str = "ced",
               ced_rollback: Optional[int] = None, dspark: Optional[bool] = None,
               vision: Optional[bool] = None, head_dtype: str = "float32",
               placement: Optional[Placement] = None, overrides: Optional[dict] = None,
               expert_memory="auto", expert_policy: str = "lfru", expert_threads: int = 8,
               expert_prefetch: int = 0):
    """Load a model folder: the published Hugging Face layout, or one written by
    `mlx_v41.convert`. Engram tables are memory-mapped, never read into memory.

    Args:
        path: folder with config.json, model.safetensors.index.json and the shards (published
            layout), or a converted folder (it holds mlx_v41_convert.json).
        compat_reference_index_k_bug: reproduce the reference's stale index-key handle at decode
            (docs/correctness.md, "Deviations from the reference"); only for parity tests.
        prefill_mode: "ced" (default: exact encoder-only prefill with the decoder halo),
            "full" (every layer over every row, like the reference) or "ced_replay" (the tech
            report's bounded replay: APPROXIMATE, opt-in).
        ced_rollback: tokens `trim_cache` can undo right after a CED prefill; the decoder
            halo grows by this many rows per layer. Default (None): window + 1, the same as
            after decoding or a full prefill; 0 gives the minimal halo (trim of 1).
        dspark: load the DSpark drafter into `model.dspark` (the `mtp.*` tensors of a
            published folder, the `dspark-*` files of a converted one), which
            `stream_generate(..., draft="dspark")` needs. Default (None): load it when the
            folder has it (and an overridden window still lets a verification roll
            back). True: a folder without it raises CheckpointError (a window too small
            for it, ConfigError). False: its tensors are left unread (7.93 GB at full
            size), and no forward pays for the drafter's rings.
        vision: load the vision tower (`vision.*`, `aligner.*`, `image_*`: 0.49 B parameters
            at full size, BF16) for image prompts. None (default): when the checkpoint has
            it; True: required (CheckpointError without it); False: left unread.
        head_dtype: the LM head's weights: "float32" (default, the reference's fp32 head) or
            "bfloat16" (half the bytes a token reads; the logits are rounded to bf16, see
            docs/correctness.md, "Deviations from the reference").
        placement: which model is built and which tensors (and which share of each) it
            reads (`checkpoint.placement`): default a `Model` reading every tensor whole; a
            rank of a group passes its own (`mlx_v41.distributed`).
        overrides: load-time values of the sparse-attention knobs (docs/quality.md):
            {"index_topk": k, "candidate_topk_blocks": n, "sliding_window": w}, any subset;
            the window at most the checkpoint's. A ConfigError names the key of an unknown
            key or a value the weights cannot honour. Recorded as `model.overrides` (the
            values that differ from the checkpoint's), which prompt caches compare.
        expert_memory: the routed experts' memory (docs/memory.md): "auto" (default:
            resident when the weights fit the machine's working set with room for the
            caches, else streamed in the room left), "resident", or a budget (bytes, or a
            string such as "48GB", "512MB"): at most that many bytes of experts are held in
            slots, the others read from the folder's files when routed; the logits are the
            resident model's bits. A budget below one expert per layout or above all the
            experts is a ValueError. `model.expert_plan.line()` says what was chosen;
            `model.expert_store` (None when resident) holds the slots and their `stats`.
        expert_policy: which slot a missing expert takes: "lfru" (default: the lowest
            decayed use count, the last token's experts spared) or "lru".
        expert_threads: concurrent reads of a streamed load.
        expert_prefetch: experts read ahead for the next MoE call while one computes (host
            buffers beside the budget): 0 (default) reads only what a call routes to; 16 is
            the suggested value to try (docs/memory.md, "Read-ahead").
    Returns:
        The `Model`, weights loaded and evaluated.
    """
    from .converted import is_converted, load_converted
    from ..model.engram_hash import EngramHasher
    from .loader import load_weights
    from .placement import WHOLE
    from .streaming import setup

    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: model folder not found")
    checkpoint_args = ModelArgs.from_file(folder / "config.json")
    args = with_overrides(checkpoint_args, overrides)
    if dspark is None:
        dspark = has_drafter(folder) and _drafts_fit(args.text_config)
    elif dspark and not _drafts_fit(args.text_config):
        raise ConfigError(f"overrides.sliding_window: {args.text_config.sliding_window} is too "
                          "small for the DSpark drafter (a verification rolls back up to "
                          f"{args.text_config.dspark_block_size} tokens: a window of at least "
                          f"{args.text_config.dspark_block_size - 1}); load without it")
    vision = has_vision_tower(folder) if vision is None else vision
    placement = WHOLE if placement is None else placement
    model = placement.build(args, compat_reference_index_k_bug=compat_reference_index_k_bug,
                            prefill_mode=prefill_mode, ced_rollback=ced_rollback,
                            dspark=dspark, vision=vision, head_dtype=head_dtype)
    streaming = None

    def experts(built):  # once the quantized layouts are final, before any tensor is read
        nonlocal streaming
        model.expert_plan, streaming = setup(built, expert_memory, args.text_config)
        return streaming

    model.expert_store = None
    token_map = None
    if is_converted(folder):
        token_map = load_converted(model, folder, placement, experts)
    else:
        load_weights(model, folder, placement, experts)
    if streaming is not None:
        streaming.finish(model, expert_policy, expert_threads, expert_prefetch)
    if args.text_config.engram_layer_ids:
        if token_map is None:
            token_map = _token_map(folder, args.text_config)
        model.engram_hasher = EngramHasher.from_config(args.text_config, token_map)
    model.weights_fingerprint = weights_fingerprint(folder)
    # read-only, and kept out of the module tree (nn.Module holds dict attributes as children)
    model.overrides = MappingProxyType({k: v for k, v in sorted((overrides or {}).items())
                                        if getattr(checkpoint_args.text_config, k) != v})
    model.pair_projections()  # the projections that read one input: one matmul each
    return model
