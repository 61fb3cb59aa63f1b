"""Reading streamed experts' bytes from the model folder (`expert_store.py`): each part of an
expert (a projection's packed weight, scales, biases) is one contiguous byte region of a
safetensors file, read with `pread` on a small pool of threads (reads release the GIL, and an
SSD needs several in flight to reach its bandwidth) straight into the staging buffer.

The bytes are kept out of the page cache: on macOS unified memory IS the page cache, so a
cached read would hold each expert twice (the slot, and the file's pages). macOS: the file is
opened with `F_NOCACHE`; Linux: `posix_fadvise(DONTNEED)` drops the region's pages after the
read. `cache_pages=True` keeps the kernel's default (a warm-cache benchmark).
"""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ..errors import CheckpointError

DEFAULT_THREADS = 8
F_NOCACHE = 48  # <sys/fcntl.h> on macOS; Python's fcntl module names it from 3.12 only
E8M0_NAN = 255  # never a valid E8M0 scale byte: a damaged published shard


class ExpertReadError(CheckpointError):
    """An expert's bytes could not be read (a truncated, replaced or unreadable file); the
    message names the file and the tensor."""


@dataclass(frozen=True)
class Region:
    """One part of one expert: `nbytes` at byte `offset` of `path`, part of `tensor`.
    `e8m0`: the bytes are E8M0 scales (a NaN byte 255 is refused, as at a resident load)."""

    path: str
    offset: int
    nbytes: int
    tensor: str
    e8m0: bool = False


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    if hasattr(os, "preadv"):  # into the buffer, no copy
        return os.preadv(fd, [view], offset)
    data = os.pread(fd, len(view), offset)  # an interpreter built without preadv
    view[:len(data)] = data
    return len(data)


class FileReader:
    """pread of regions on a thread pool, out of the page cache (module docstring)."""

    def __init__(self, threads: int = DEFAULT_THREADS, cache_pages: bool = False):
        self.cache_pages = cache_pages
        self.threads = max(1, threads)
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="mlx_v41-experts")
        self.fds: dict = {}
        self.lock = threading.Lock()

    def _fd(self, path: str) -> int:
        with self.lock:
            fd = self.fds.get(path)
            if fd is None:
                fd = os.open(path, os.O_RDONLY)
                if sys.platform == "darwin" and not self.cache_pages:
                    import fcntl
                    fcntl.fcntl(fd, getattr(fcntl, "F_NOCACHE", F_NOCACHE), 1)
                self.fds[path] = fd
            return fd

    def read(self, region: Region, out: np.ndarray) -> None:
        """Fill `out` (a contiguous uint8 array of `region.nbytes`) from the file."""
        view, done = memoryview(out).cast("B"), 0
        try:
            fd = self._fd(region.path)
            while done < region.nbytes:
                n = _pread_into(fd, view[done:], region.offset + done)
                if n == 0:
                    raise ExpertReadError(
                        f"{region.path}: tensor {region.tensor} is truncated (the file ends "
                        f"{done} of its {region.nbytes} bytes in)")
                done += n
            if not self.cache_pages and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, region.offset, region.nbytes, os.POSIX_FADV_DONTNEED)
        except OSError as e:
            raise ExpertReadError(f"{region.path}: tensor {region.tensor} cannot be read "
                                  f"({e.strerror or e})") from None
        if region.e8m0 and (out == E8M0_NAN).any():
            raise ExpertReadError(f"{region.path}: tensor {region.tensor} holds the E8M0 NaN "
                                  "byte 255")

    def read_all(self, jobs: list) -> None:
        """jobs: (region, out) pairs, read concurrently; the first failure is raised once
        every read has ended (no thread is left writing into a buffer)."""
        if len(jobs) == 1 or self.threads == 1:
            for region, out in jobs:
                self.read(region, out)
            return
        futures = [self.pool.submit(self.read, region, out) for region, out in jobs]
        errors = [f.exception() for f in futures]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        with self.lock:
            for fd in self.fds.values():
                os.close(fd)
            self.fds.clear()
