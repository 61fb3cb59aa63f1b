"""Writing the output: safetensors files streamed block by block under a running sha256, in a
temporary sibling folder `<mlx-path>.partial` whose manifest records each finished file (size +
sha256). A re-run with the same input and settings keeps the finished files that still verify
and redoes the rest; the folder becomes `--mlx-path` by one rename once everything is written.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable

from mlx_v41.checkpoint.converted import MANIFEST

from .plan import FORMAT, OutFile
from .source import ConvertError, Source

PARTIAL_SUFFIX = ".partial"
INCOMPLETE_SUFFIX = ".incomplete"
HASH_BLOCK = 16 * 1024 * 1024
SPACE_MARGIN = 64 * 1024 * 1024  # free space kept beyond the planned bytes


def _write(handle, block) -> None:
    """One block to disk (the single write path; tests replace it to simulate a full disk)."""
    handle.write(block)


def write_file(path: Path, out: OutFile, source: Source, progress: Callable) -> dict:
    """Write `out` to `path` (through a temporary name); returns {bytes, sha256}."""
    tmp = path.with_name(path.name + INCOMPLETE_SUFFIX)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as handle:
            for block in _blocks(out, source):
                _write(handle, block)
                digest.update(block)
                progress(len(block))
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)  # frees the space at once; a kill leaves it to the re-run
        raise
    if tmp.stat().st_size != out.size:
        raise RuntimeError(f"{out.name}: wrote {tmp.stat().st_size} bytes, planned {out.size}")
    tmp.replace(path)
    return {"bytes": out.size, "sha256": digest.hexdigest()}


def _blocks(out: OutFile, source: Source):
    """The header, then every tensor's bytes, checked against the plan tensor by tensor."""
    yield out.header()
    for item in out.items:
        written = {t.name: 0 for t in item.tensors}
        order = [t.name for t in item.tensors]
        for name, block in item.produce(source):
            if name != order[0]:
                raise RuntimeError(f"{out.name}: {name} produced out of the planned order")
            written[name] += len(block)
            if written[name] == next(t.nbytes for t in item.tensors if t.name == name):
                order.pop(0)
            yield block
        if order:
            raise RuntimeError(f"{out.name}: {order[0]} was not produced in full")


def file_digest(path: Path, progress: Callable) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            digest.update(block)
            progress(len(block))
    return digest.hexdigest()


class Workspace:
    """The temporary sibling folder of one conversion, with its manifest."""

    def __init__(self, final: Path, fingerprint: str):
        self.final = final
        self.path = final.with_name(final.name + PARTIAL_SUFFIX)
        self.fingerprint = fingerprint
        self.manifest = {"format": FORMAT, "complete": False, "fingerprint": fingerprint,
                         "files": {}}
        self.owned = False

    def open(self, planned: dict, progress: Callable) -> set:
        """Create the folder or resume it; -> names of finished files that verify.

        planned: {relative file name: size in bytes}.
        """
        old = self._previous()
        self.owned = True  # empty, or an unfinished conversion of exactly this plan
        self.path.mkdir(parents=True, exist_ok=True)
        reused = set()
        for name, info in (old or {}).get("files", {}).items():
            path = self.path / name
            if planned.get(name) == info.get("bytes") and path.is_file() \
                    and path.stat().st_size == info["bytes"] \
                    and file_digest(path, progress) == info.get("sha256"):
                reused.add(name)
                self.manifest["files"][name] = info
        self._remove_all_but(reused)
        self.save()
        return reused

    def _previous(self):
        if not self.path.exists():
            return None
        manifest = self.path / MANIFEST
        if not manifest.is_file():
            if self.path.is_dir() and not any(self.path.iterdir()):
                return None
            raise ConvertError(f"{self.path} exists and is not an unfinished conversion; "
                               "remove it or choose another --mlx-path")
        try:
            old = json.loads(manifest.read_text())
        except json.JSONDecodeError:
            old = {}
        if old.get("fingerprint") != self.fingerprint:
            raise ConvertError(f"{self.path} holds an unfinished conversion of other input or "
                               "settings; re-run those to resume it, or remove it")
        return old

    def _remove_all_but(self, keep: set) -> None:
        for path in sorted(self.path.rglob("*"), reverse=True):
            rel = path.relative_to(self.path).as_posix()
            if path.is_file() and rel not in keep and rel != MANIFEST:
                path.unlink()
            elif path.is_dir() and not any(path.iterdir()):
                path.rmdir()

    def discard(self) -> None:
        """Remove the folder, if open() found it empty or ours."""
        if self.owned:
            shutil.rmtree(self.path, ignore_errors=True)

    def check_space(self, needed: int) -> None:
        free = shutil.disk_usage(self.path).free
        if free < needed + SPACE_MARGIN:
            raise ConvertError(f"not enough disk space at {self.path.parent}: the conversion "
                               f"needs {needed / 1e9:.2f} GB more, {free / 1e9:.2f} GB free")

    def record(self, name: str, info: dict) -> None:
        self.manifest["files"][name] = info
        self.save()

    def save(self) -> None:
        self.manifest["files"] = dict(sorted(self.manifest["files"].items()))
        write_atomic(self.path / MANIFEST, json.dumps(self.manifest, indent=1).encode())

    def finish(self, fields: dict) -> None:
        """Mark complete and move into place (one rename; an empty --mlx-path is replaced)."""
        self.manifest.update(fields)
        self.manifest["complete"] = True
        self.save()
        if self.final.is_dir():
            self.final.rmdir()      # only ever empty here: checked before starting
        os.rename(self.path, self.final)
        _fsync_dir(self.final.parent)


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + INCOMPLETE_SUFFIX)
    with open(tmp, "wb") as f:
        _write(f, data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
