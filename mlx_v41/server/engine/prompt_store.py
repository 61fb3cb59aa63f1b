"""The server's prompt caches: an LRU of cached token prefixes bounded in bytes (`cache_bytes`),
reused by the longest common prefix (tokens, and the image each span came from), optionally
mirrored in a folder so that a restarted server starts warm. Files carry the model's
fingerprints (config, weights, prefill mode) and are refused for any other model. mlx-lm's
`LRUPromptCache` is not used: it deep-copies caches and trims with its own helpers, while ours
copy for free and roll back only as far as `trim_cache` stays exact.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

from ...cache.layer import CacheError, cache_bytes, trim_cache
from ...cache.persistence import fingerprints
from ...distributed.cache_files import rank_path
from ...distributed.group import RankGroup
from ...distributed.lines import share_line
from ...generation.group import ONE_PROCESS, ProcessGroup
from ...generation.prompt_reuse import (PromptCache, kept_prefix, read_prompt_cache,
                                       shared_spans, write_prompt_cache)

log = logging.getLogger("mlx_v41.server")

ENTRY_FORMAT = "mlx_v41.server_prompt_cache.v1"
SUFFIX = ".safetensors"


class StoreMismatch(RuntimeError):
    """A decision names an entry this store lacks or a rollback it cannot do (across ranks:
    the stores have parted ways)."""


@dataclass
class _Entry:
    """One cached prefix: the cache, its tokens (also as an array for fast prefix matching)
    and image spans (in `state.images`), its key, its bytes, when it was last used and its
    file (when persisted)."""

    state: PromptCache
    ids: np.ndarray
    key: int
    nbytes: int
    used: int
    path: Optional[Path] = None
    is_written: bool = False


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _rollback(cache: list) -> int:
    """Tokens `trim_cache` can undo exactly on this cache."""
    return min(c.max_trim() for c in cache)


class PromptCacheStore:
    """Cached prefixes of one model, at most `max_bytes` in all (counted per entry with
    `cache_bytes`; entries share unchanged arrays, so real memory is at most this).

    `fetch` returns a rewound copy (the stored entry is never changed), `insert` takes a state
    the caller no longer uses, `flush` writes new entries to `folder`. Each is a decision
    (`choose`, `admit`: plain JSON values naming entries by key) then its application (`take`,
    `apply`), so the stores of several ranks can apply one rank's decisions to their own
    shares of the caches. Not thread-safe: the engine's worker thread is its only user.
    """

    def __init__(self, model, max_bytes: int, folder=None, group: ProcessGroup = ONE_PROCESS):
        self.model, self.max_bytes, self.group = model, max_bytes, group
        self.folder = None if folder is None else Path(folder)
        self.entries: list[_Entry] = []
        self._clock = 0
        # a rank of a group: files written together, rank 0's decisions applied
        self.link = group.link if isinstance(group, RankGroup) else None
        self._identity = json.dumps(fingerprints(model), sort_keys=True)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _entry(self, key: int) -> _Entry:
        for entry in self.entries:
            if entry.key == key:
                return entry
        raise StoreMismatch(f"no prompt-cache entry {key} in this store")

    def fetch(self, prompt: list, images: list = ()) -> PromptCache:
        """A copy of the entry sharing the longest prefix with `prompt` and its image spans
        `images` (`ImagePrompt.records()`), rewound to it (at least one prompt token is left
        to run), or an empty cache."""
        return self.take(self.choose(prompt, images))

    def choose(self, prompt: list, images: list = ()) -> Optional[list]:
        """[key, tokens kept] of the entry `fetch` rewinds for `prompt`, or None."""
        ids, images = np.asarray(prompt, dtype=np.int64), list(images)
        ranked = sorted(((_shared(e, ids, images), e) for e in self.entries),
                        key=lambda pair: -pair[0])
        for shared, entry in ranked:
            if shared == 0:
                break
            keep = kept_prefix(common_prefix(entry.ids, ids), len(ids), entry.state.images,
                               images)
            if len(entry.ids) - keep <= _rollback(entry.state.cache):
                return [entry.key, keep]
        return None

    def take(self, choice: Optional[list]) -> PromptCache:
        """A copy of entry `choice[0]` rewound to its first `choice[1]` tokens (None: an empty
        cache); the entry counts as used."""
        if choice is None:
            return PromptCache(self.model.make_cache())
        key, keep = choice
        entry = self._entry(key)
        trial = entry.state.copy()
        if trial.rewind_to(keep) is None:
            raise StoreMismatch(f"prompt-cache entry {key} cannot roll back to {keep} tokens")
        entry.used = self._tick()
        _touch(entry)
        return trial

    def insert(self, state: PromptCache, nbytes: Optional[int] = None) -> Optional[_Entry]:
        """Keep `state` (its cache must hold exactly its tokens), counted as `nbytes` (default:
        its cache's bytes); returns its entry, or None when it is not kept. An entry the new
        one extends within its exact rollback is dropped; the new one is not kept when an
        entry covers it or it alone is over budget."""
        return self.apply(state, self.admit(state, nbytes))

    def admit(self, state: PromptCache, nbytes: Optional[int] = None) -> dict:
        """What `insert` does with `state`, counted as `nbytes` (default: its cache's bytes):
        {"key": its key (None: not kept), "bytes", "drop": keys of the entries it drops,
        "touch": the key of an entry that covers it (used now)}."""
        decision = {"key": None, "bytes": 0, "drop": [], "touch": None}
        if not state.tokens or state.cache[0].offset != len(state.tokens):
            return decision
        nbytes = cache_bytes(state.cache)["total"] if nbytes is None else nbytes
        if nbytes > self.max_bytes:
            return decision
        new = _Entry(state, np.asarray(state.tokens, dtype=np.int64), -1, nbytes, 0)
        for old in self.entries:
            if _covers(old, new) and len(old.ids) > len(new.ids):
                return {**decision, "touch": old.key}
            if _covers(new, old):
                decision["drop"].append(old.key)
        kept = [e for e in self.entries if e.key not in decision["drop"]]
        total = nbytes + sum(e.nbytes for e in kept)
        for old in sorted(kept, key=lambda e: e.used):  # least recently used first
            if total <= self.max_bytes:
                break
            decision["drop"].append(old.key)
            total -= old.nbytes
        return {**decision, "key": self._tick(), "bytes": nbytes}

    def apply(self, state: PromptCache, decision: dict) -> Optional[_Entry]:
        """Do what `admit` decided (here or on another rank); returns the new entry or None."""
        for key in decision["drop"]:
            self._drop(self._entry(key))
        if decision["touch"] is not None:
            self._entry(decision["touch"]).used = self._tick()
        if decision["key"] is None:
            return None
        # Stored arrays must be computed, not graphs (a prefill leaves the compressors' input
        # rings lazy): a graph keeps its inputs alive, and MLX aborts at exit when it frees one
        # built on a thread that has ended.
        mx.eval([c.state for c in state.cache])
        entry = _Entry(state, np.asarray(state.tokens, dtype=np.int64), decision["key"],
                       decision["bytes"], self._tick())
        self.entries.append(entry)
        return entry

    def _drop(self, entry: _Entry) -> None:
        self.entries.remove(entry)
        if entry.path is not None:
            entry.path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ persistence

    def _file_for(self, state: PromptCache) -> Path:
        digest = hashlib.sha256(self._identity.encode())
        digest.update(np.asarray(state.tokens, dtype=np.int64).tobytes())
        digest.update(json.dumps(state.images, sort_keys=True).encode())
        return self.folder / f"prompt-{digest.hexdigest()[:32]}{SUFFIX}"

    def flush(self) -> None:
        """Write the entries not on disk yet (atomically; a failed write is logged and the
        entry stays in memory only)."""
        if self.folder is None:
            return
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # e.g. replaced by a file: the entries stay in memory only
            if self.link is None:  # (across ranks each rank's write fails below, together)
                if not all(entry.is_written for entry in self.entries):
                    log.warning("prompt caches not persisted: cannot make the folder %s (%s)",
                                self.folder, e.strerror or e)
                return
        for entry in self.entries:
            if entry.is_written:
                continue
            name = self._file_for(entry.state)
            try:  # across ranks every rank writes its share, or none does
                write_prompt_cache(name, entry.state.cache, self.model,
                                   {"format": ENTRY_FORMAT, **entry.state.metadata()}, self.group)
                entry.path, entry.is_written = self._own(name), True
            except OSError as e:
                log.warning("prompt cache not persisted: %s", e)
                entry.path = None

    def _own(self, name: Path) -> Path:
        """This rank's file of the entry file `name` (`name.rank<r>-of-<n>` on rank r > 0)."""
        return name if self.link is None else rank_path(name, self.link)

    def load_folder(self) -> int:
        """Load the folder's entries of this model, most recently used first, as far as
        `max_bytes` allows (ours that do not fit are deleted); files of another model or
        version are refused (logged, kept). Returns the entries loaded."""
        if self.folder is None:
            return 0
        self.folder.mkdir(parents=True, exist_ok=True)
        files = sorted((p for p in self.folder.glob(f"*{SUFFIX}") if not p.name.startswith(".")),
                       key=lambda p: -p.stat().st_mtime)  # dot files: interrupted writes
        if self.link is not None:  # every rank loads rank 0's files, in its order
            names = share_line(self.link, json.dumps([p.name for p in files]))
            files = [self.folder / name for name in json.loads(names)]
        loaded = []
        for path in files:
            state = self._read(path)
            if state is None:
                continue
            nbytes = largest_shares(self.link, [state])[0] if self.link is not None else \
                cache_bytes(state.cache)["total"]
            entry = self.insert(state, nbytes) if self.nbytes + nbytes <= self.max_bytes \
                else None
            if entry is None:
                self._own(path).unlink(missing_ok=True)
                continue
            entry.path, entry.is_written = self._own(path), True
            loaded.append(entry)
        for entry in reversed(loaded):  # the newest file is the most recently used
            entry.used = self._tick()
        return len(self.entries)

    def _read(self, path: Path) -> Optional[PromptCache]:
        try:  # across ranks every rank reads its share, and all refuse if one cannot
            cache, meta = read_prompt_cache(path, self.model, self.group)
        except CacheError as e:
            log.warning("prompt cache refused: %s", e)
            return None
        if meta.get("format") != ENTRY_FORMAT:
            log.warning("prompt cache refused: %s: not a server prompt-cache entry", path)
            return None
        state = PromptCache.from_metadata(cache, meta)
        if cache[0].offset != len(state.tokens):
            log.warning("prompt cache refused: %s: %d tokens listed for %d cached positions",
                        path, len(state.tokens), cache[0].offset)
            return None
        return state


def _touch(entry: _Entry) -> None:
    """Mark a persisted entry used, so the folder keeps the LRU order across restarts."""
    if entry.path is not None and entry.is_written:
        try:
            os.utime(entry.path)
        except OSError:  # removed behind our back: the next flush writes it again
            entry.path, entry.is_written = None, False


def _shared(entry: _Entry, ids: np.ndarray, images: list) -> int:
    """Positions `entry` shares with a prompt: the common token prefix, cut at the first image
    span that came from another image."""
    return shared_spans(common_prefix(entry.ids, ids), entry.state.images, images)


def _covers(big: _Entry, small: _Entry) -> bool:
    """`big` can stand in for `small`: its tokens and image spans extend `small`'s and it can
    roll back to them exactly."""
    extra = len(big.ids) - len(small.ids)
    return (extra >= 0 and _shared(big, small.ids, small.state.images) == len(small.ids)
            and extra <= _rollback(big.state.cache))


def align_to_tokens(state: PromptCache) -> bool:
    """Make the cache hold exactly `state.tokens` (a speculative stream stopped early may have
    fed drafts it did not yield). False when that needs more rollback than is exact."""
    extra = state.cache[0].offset - len(state.tokens)
    if extra == 0:
        return True
    try:
        trim_cache(state.cache, extra)
    except CacheError:
        return False
    return True


def largest_shares(link, states: list) -> list:
    """Per state, the most bytes its cache holds on any rank (None where a rank keeps none):
    one `all_gather` of 2 int32s per state (bytes split at bit 31; -1 for none)."""
    mine = []
    for state in states:
        n = None if state is None else cache_bytes(state.cache)["total"]
        mine += [-1, 0] if n is None else [n >> 31, n & 0x7FFFFFFF]
    shares = np.array(link.all_gather(mx.array(mine, mx.int32), "sharing prompt-cache sizes"),
                      dtype=np.int64).reshape(link.size, len(states), 2)
    return [None if (s[:, 0] < 0).any() else int(((s[:, 0] << 31) + s[:, 1]).max())
            for s in shares.transpose(1, 0, 2)]
