"""Prompt reuse: a cache with the tokens it holds, rewound to the longest prefix a new prompt
shares with it (chat turns, prompt-cache files).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence


from ..cache.layer import CacheError, trim_cache
from ..cache.persistence import copy_cache, save_prompt_cache


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n



@dataclass
class PromptCache:
    """A model cache and the token ids it holds (prompt and fed tokens, in order)."""

    cache: list
    tokens: List[int] = field(default_factory=list)

    def copy(self) -> "PromptCache":
        return PromptCache(copy_cache(self.cache), list(self.tokens))

    def rewind_for(self, prompt: Sequence[int]) -> Optional[int]:
        """Trim to the longest prefix shared with `prompt` that leaves at least one prompt
        token to run (its logits start the reply). Returns the tokens kept, or None (the cache
        unchanged) when the rollback is more than the cache can undo exactly."""
        keep = min(_common_prefix(self.tokens, prompt), len(prompt) - 1)
        try:
            trim_cache(self.cache, len(self.tokens) - keep)
        except CacheError:
            return None
        del self.tokens[keep:]
        return keep



def reuse_prompt_cache(model, prompt: Sequence[int], candidates) -> tuple:
    """(cache, index): a rewound copy of the candidate that keeps the longest prefix of
    `prompt` and its index, or a new empty cache and None. Candidates are left untouched;
    None entries are skipped."""
    best, index = PromptCache(model.make_cache()), None
    for i, candidate in enumerate(candidates):
        if candidate is None:
            continue
        trial = candidate.copy()
        kept = trial.rewind_for(prompt)
        if kept is not None and (index is None or kept > len(best.tokens)):
            best, index = trial, i
    return best, index



def write_prompt_cache(path, cache: list, model, metadata: dict) -> None:
    """`save_prompt_cache` with file-system problems reported as OSError naming the file."""
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"{path.parent}: no such folder")
    try:
        save_prompt_cache(path, cache, model, metadata)
    except RuntimeError as e:  # MLX reports write failures as RuntimeError
        raise OSError(f"{path}: cannot write the prompt cache ({e})") from None
