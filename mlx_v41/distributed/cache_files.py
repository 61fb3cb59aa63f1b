"""Prompt-cache files across the ranks of a group: each rank writes and reads its own share of
the cache in its own file, `F` on rank 0 and `F.rank{r}-of-{n}` beside it on rank r. A save
lands only once every rank wrote its part, a load is used only if every rank read its part of
the same save; otherwise every rank raises the same one-line error."""

from __future__ import annotations

import uuid
from pathlib import Path

import mlx.core as mx

from ..cache.layer import CacheError
from ..cache.persistence import commit_staged, load_prompt_cache
from .lines import exchange, share_line

SAVE_ID = "group_save"  # metadata key: the save a rank's file belongs to (one id per save)


def rank_path(path, link) -> Path:
    """This rank's file of the group's prompt cache `path`."""
    path = Path(path)
    if link.rank == 0:
        return path
    return path.with_name(f"{path.name}.rank{link.rank}-of-{link.size}")


def exists_on_any_rank(path, link) -> bool:
    """Whether any rank has its file of `path` (one `all_sum`): then the group loads it."""
    mine = mx.array([int(rank_path(path, link).exists())], mx.int32)
    return int(link.all_sum(mine, "agreeing on a cache file").item()) > 0


def save_across_ranks(path, cache: list, model, metadata: dict, stage, group) -> None:
    """Every rank of `group` (a `RankGroup`) stages its share beside its `rank_path`
    (`stage(path, cache, model, metadata, share)` -> the staged file); then all rename, or, if
    any rank could not write, all delete theirs and raise that rank's OSError (the old files
    untouched)."""
    link = group.link
    save = share_line(link, uuid.uuid4().hex if link.rank == 0 else None)
    target, staged, error = rank_path(path, link), None, None
    try:
        staged = stage(target, cache, model, {**metadata, SAVE_ID: save}, group.share)
    except Exception as e:  # every rank must reach the exchange
        error = _one_line(e)
    failure = _first_failure(exchange(link, {"error": error}, "agreeing on a cache save"))
    if failure is not None:
        if staged is not None:
            staged.unlink(missing_ok=True)
        raise OSError(failure)
    commit_staged(staged, target)


def load_across_ranks(path, model, group) -> tuple:
    """(this rank's cache, the metadata) when every rank of `group` read its part of one save,
    with the group's rollback budget (the smallest); otherwise the first failing rank's
    CacheError on every rank."""
    link = group.link
    cache = meta = error = None
    try:
        cache, meta = load_prompt_cache(rank_path(path, link), model, return_metadata=True,
                                        share=group.share)
    except Exception as e:  # every rank must reach the exchange
        error = _one_line(e)
    mine = {"error": error} if error is not None else \
        {"error": None, "save": meta.get(SAVE_ID), "budget": cache[0].trim_budget}
    records = exchange(link, mine, "agreeing on a cache load")
    failure = _first_failure(records)
    if failure is not None:
        raise CacheError(failure)
    saves = [r["save"] for r in records]
    if None in saves or len(set(saves)) > 1:
        odd = next(r for r, s in enumerate(saves) if s is None or s != saves[0])
        raise CacheError(f"{path}: rank {odd}'s file is not from the same save as rank 0's "
                         "(save all ranks again)")
    budget = min(r["budget"] for r in records)
    for c in cache:
        c.trim_budget = budget
    meta.pop(SAVE_ID)
    return cache, meta


def _first_failure(records: list):
    for rank, record in enumerate(records):
        if record["error"] is not None:
            return f"rank {rank}: {record['error']}"
    return None


def _one_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return (text[0] if text else type(error).__name__)[:400]
