"""How the processes running one model agree, as generation sees them: on the prompt, on each
sampled token, on DSpark's drafts and acceptance, and on prompt-cache files. One process agrees
with itself (`ONE_PROCESS`, what every generation function uses unless given a group); the ranks
of a pipeline or tensor-parallel group are `mlx_v41.distributed.group.RankGroup`.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Callable, Optional, Sequence

import mlx.core as mx

from ..cache.persistence import commit_staged, load_prompt_cache
from ..model.vision.prompt import ImagePrompt, prepare_prompt


class ProcessGroup:
    """One process: it holds the logits, decides alone, and keeps plain prompt-cache files."""

    has_logits = True  # whether the logits (and the DSpark acceptance) are computed here

    def prepare_prompt(self, model, ids: Sequence[int], images: Optional[Sequence] = None
                       ) -> ImagePrompt:
        """`ids` with each image placeholder expanded into its span (`prepare_prompt`)."""
        return prepare_prompt(model, ids, images)

    def agree_on_token(self, token: mx.array) -> mx.array:
        """The sampled token every process continues with."""
        return token

    def agree_on_ints(self, values: list, size: int) -> list:
        """The ints (at most `size`: drafts, an acceptance) every process continues with."""
        return list(values)

    def busy(self, what: str):
        """A context around a prefill or a reply (a group watches it for a stuck rank)."""
        return nullcontext()

    def save_prompt_cache(self, path, cache: list, model, metadata: dict,
                          stage: Callable) -> None:
        """Write `cache` to `path`: `stage(path, cache, model, metadata, share)` writes it
        under a temporary name (returned), which is then renamed to `path`."""
        commit_staged(stage(path, cache, model, metadata, None), path)

    def load_prompt_cache(self, path, model) -> tuple:
        """(cache, metadata) of the prompt-cache file `path`."""
        return load_prompt_cache(path, model, return_metadata=True)

    def has_prompt_cache(self, path) -> bool:
        return Path(path).exists()


ONE_PROCESS = ProcessGroup()
