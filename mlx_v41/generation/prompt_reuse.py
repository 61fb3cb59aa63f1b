"""Prompt reuse: a cache with the tokens it holds, rewound to the longest prefix a new prompt
shares with it (chat turns, prompt-cache files). Image spans repeat one placeholder id, so the
cache also records which image (sha256 of its pixels) each span came from: a prefix is shared
only up to the first span whose image differs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence


from ..cache.layer import CacheError, trim_cache
from ..cache.persistence import copy_cache, stage_prompt_cache
from .group import ONE_PROCESS, ProcessGroup


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def shared_spans(keep: int, held: list, wanted: list) -> int:
    """`keep` cut at the first image span before it that the other side lacks or holds from
    another image (records: {"start", "length", "sha256"})."""
    by_start = {r["start"]: r for r in wanted}
    held_starts = {r["start"] for r in held}
    for record in sorted(held, key=lambda r: r["start"]):
        if record["start"] < keep and by_start.get(record["start"]) != record:
            keep = record["start"]
    for record in wanted:
        if record["start"] < keep and record["start"] not in held_starts:
            keep = record["start"]
    return keep


@dataclass
class PromptCache:
    """A model cache, the token ids it holds (prompt and fed tokens, in order) and its image
    spans (`ImagePrompt.records()`: start, length, sha256 of the pixels)."""

    cache: list
    tokens: List[int] = field(default_factory=list)
    images: list = field(default_factory=list)

    @classmethod
    def from_metadata(cls, cache: list, meta: dict) -> "PromptCache":
        return cls(cache, json.loads(meta["tokens"]), json.loads(meta.get("images", "[]")))

    def metadata(self) -> dict:
        """What a prompt-cache file records of the positions (see `from_metadata`)."""
        return {"tokens": json.dumps(self.tokens), "images": json.dumps(self.images)}

    def copy(self) -> "PromptCache":
        return PromptCache(copy_cache(self.cache), list(self.tokens), list(self.images))

    def rewind_for(self, prompt: Sequence[int], images: Sequence[dict] = ()) -> Optional[int]:
        """Trim to the longest prefix shared with `prompt` (and its image spans `images`) that
        leaves at least one prompt token to run (its logits start the reply). Returns the
        tokens kept, or None (the cache unchanged) when the rollback is more than the cache
        can undo exactly."""
        return self.rewind_to(kept_prefix(common_prefix(self.tokens, prompt), len(prompt),
                                          self.images, images))

    def rewind_to(self, keep: int) -> Optional[int]:
        """Trim to the first `keep` tokens; `keep`, or None (unchanged) past the exact
        rollback."""
        try:
            trim_cache(self.cache, len(self.tokens) - keep)
        except CacheError:
            return None
        del self.tokens[keep:]
        self.images = [r for r in self.images if r["start"] < keep]
        return keep


def kept_prefix(common: int, prompt_length: int, held: list, wanted: Sequence[dict]) -> int:
    """Tokens a cache keeps for a prompt it shares `common` tokens with: at least one prompt
    token is left to run (its logits start the reply), and none past an image span that
    differs (`shared_spans`)."""
    return shared_spans(min(common, prompt_length - 1), held, list(wanted))


def reuse_prompt_cache(model, prompt: Sequence[int], candidates, images: Sequence[dict] = ()
                       ) -> tuple:
    """(cache, index): a rewound copy of the candidate that keeps the longest prefix of
    `prompt` (with image spans `images`) and its index, or a new empty cache and None.
    Candidates are left untouched; None entries are skipped."""
    best, index = PromptCache(model.make_cache()), None
    for i, candidate in enumerate(candidates):
        if candidate is None:
            continue
        trial = candidate.copy()
        kept = trial.rewind_for(prompt, images)
        if kept is not None and (index is None or kept > len(best.tokens)):
            best, index = trial, i
    return best, index


def write_prompt_cache(path, cache: list, model, metadata: dict,
                       group: ProcessGroup = ONE_PROCESS) -> None:
    """`save_prompt_cache` with file-system problems reported as OSError naming the file;
    across the ranks of `group`, every rank writes its share."""
    group.save_prompt_cache(path, cache, model, metadata, stage_cache_file)


def read_prompt_cache(path, model, group: ProcessGroup = ONE_PROCESS) -> tuple:
    """(cache, metadata) of a prompt-cache file (`load_prompt_cache`); across the ranks of
    `group`, every rank reads its share, and all refuse if one cannot."""
    return group.load_prompt_cache(path, model)


def prompt_cache_exists(path, group: ProcessGroup = ONE_PROCESS) -> bool:
    """Whether the prompt-cache file exists (across the ranks of `group`: on any rank)."""
    return group.has_prompt_cache(path)


def stage_cache_file(path, cache: list, model, metadata: dict,
                     share: Optional[dict] = None) -> Path:
    """`stage_prompt_cache` with file-system problems reported as OSError naming the file."""
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"{path.parent}: no such folder")
    try:
        return stage_prompt_cache(path, cache, model, metadata, share)
    except RuntimeError as e:  # MLX reports write failures as RuntimeError
        raise OSError(f"{path}: cannot write the prompt cache ({e})") from None
