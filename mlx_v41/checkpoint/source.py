"""Where a model comes from: a local folder in the published layout, "demo" (a tiny random
checkpoint built once, see mlx_v41.demo), or a Hugging Face repo id (downloaded with
huggingface_hub); and `load`, which returns the model with its tokenizer.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from ..errors import CheckpointError

DEMO = "demo"  # --model value that builds and uses the demo checkpoint (mlx_v41.demo)
REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")
HUB_FILES = ["*.json", "*.safetensors"]  # all a published checkpoint needs


def resolve_model_path(name) -> Path:
    """A model folder from a local path, "demo", or a Hugging Face repo id (downloaded)."""
    if str(name) == DEMO:
        from .demo import ensure_demo_checkpoint

        return ensure_demo_checkpoint()
    folder = Path(name).expanduser()
    if not folder.exists() and REPO_ID.fullmatch(str(name)):
        folder = _download(str(name))
    if not folder.is_dir():
        raise CheckpointError(f"{name}: model folder not found")
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder}: config.json not found (expected a model folder in "
                              "the published Hugging Face layout)")
    return folder


def _download(repo: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo, allow_patterns=HUB_FILES))
    except Exception as e:  # the hub raises many types (offline, not found, auth, HTTP)
        line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(f"{repo}: no such folder, and the Hugging Face download failed "
                              f"({type(e).__name__}: {line})") from None


def load(path_or_repo, prefill_mode: str = "ced", compat_reference_index_k_bug: bool = False,
         ced_rollback: Optional[int] = None, dspark: Optional[bool] = None,
         vision: Optional[bool] = None, head_dtype: str = "float32", placement=None,
         overrides: Optional[dict] = None, expert_memory="auto", **expert_options):
    """Load a model and its tokenizer (`placement`: see load_model).

    Args:
        path_or_repo: a local folder in the published layout, a Hugging Face repo id, or
            "demo" (a tiny random checkpoint built once in ~/.cache/mlx_v41; see mlx_v41.demo).
        prefill_mode: "ced" (exact, default), "full" or "ced_replay" (APPROXIMATE).
        compat_reference_index_k_bug: reproduce the reference's index-key defect (parity only).
        ced_rollback: tokens a trim can undo right after a CED prefill (see load_model).
        dspark: load the DSpark drafter for `stream_generate(..., draft="dspark")`: None
            (default) when the checkpoint has it, True (required), False (skipped).
        vision: load the vision tower for image prompts (None: when the checkpoint has it).
        head_dtype: "float32" (default, the reference's LM head) or "bfloat16" (see load_model).
        overrides: load-time values of `index_topk`, `candidate_topk_blocks`,
            `sliding_window` (see load_model).
        expert_memory: "auto" (default), "resident" or a budget such as "48GB": the routed
            experts held in memory, the rest streamed from the folder (see load_model, whose
            `expert_policy` and `expert_threads` pass through too).
    Returns:
        (model, tokenizer): the `Model` and a `tokenizer.Tokenizer` (mlx-lm's TokenizerWrapper).
    Raises:
        CheckpointError / ConfigError: naming the missing or bad file.
    """
    from .load import load_model
    from ..model.config import ModelArgs
    from ..chat.tokenizer import load_tokenizer

    folder = resolve_model_path(path_or_repo)
    args = ModelArgs.from_file(folder / "config.json")
    tokenizer = load_tokenizer(folder, eos_token_ids=[args.eos_token_id])
    model = load_model(folder, compat_reference_index_k_bug=compat_reference_index_k_bug,
                       prefill_mode=prefill_mode, ced_rollback=ced_rollback, dspark=dspark,
                       vision=vision, head_dtype=head_dtype, placement=placement,
                       overrides=overrides, expert_memory=expert_memory, **expert_options)
    return model, tokenizer
