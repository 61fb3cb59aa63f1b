"""Compiler discovery, flags, precompiled shim header, on-disk cache (design note, 3.10).

Artefacts live in ``$METAL_SIM_CACHE`` (default ``~/.cache/mlx_v41/metal_sim``), named by the
SHA-256 of everything that affects them, and are built under an ``fcntl`` lock into a temporary
name, then renamed, so parallel test processes are safe.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

from .errors import MetalCompileError, MetalSimError

SHIM_DIR = Path(__file__).resolve().parent / "shim"
SHIM_HEADER = "msl_shim.h"
RUNTIME_SRC = "msim_runtime.cpp"

# -fsingle-precision-constant: unsuffixed literals are float, as in MSL.
# -ffp-contract=off: `a*b+c` rounds twice (see README on FMA).
FLAGS = ("-std=c++20", "-fPIC", "-pthread", "-fno-strict-aliasing", "-ffp-contract=off",
         "-fsingle-precision-constant", "-fno-math-errno", "-Werror=vla", "-Wno-unknown-pragmas")


def cache_dir() -> Path:
    d = Path(os.environ.get("METAL_SIM_CACHE") or Path.home() / ".cache" / "mlx_v41" / "metal_sim")
    d.mkdir(parents=True, exist_ok=True)
    return d


@lru_cache(maxsize=None)
def find_compiler(cxx: str | None = None) -> tuple[str, str]:
    """(path, `--version` text) of a C++20 compiler: g++ >= 12 or clang >= 15."""
    name = cxx or os.environ.get("METAL_SIM_CXX") or "g++"
    path = shutil.which(name)
    if path is None:
        raise MetalSimError(f"metal_sim: C++ compiler '{name}' not found (need g++ >= 12 or "
                            "clang >= 15; install g++ or set METAL_SIM_CXX)")
    version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"(clang)? ?version (\d+)|\) (\d+)\.\d+", version)
    major = int(m.group(2) or m.group(3)) if m else 0
    if ("clang" in version and major < 15) or ("clang" not in version and major < 12):
        raise MetalSimError(f"metal_sim: {path} is too old (need g++ >= 12 or clang >= 15): "
                            f"{version.splitlines()[0] if version else '?'}")
    return path, version


@lru_cache(maxsize=None)
def shim_hash() -> str:
    h = hashlib.sha256()
    for p in sorted(SHIM_DIR.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(SHIM_DIR)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def _key(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


@contextmanager
def _locked(d: Path):
    with open(d / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _run(cmd: list[str], what: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise MetalSimError(f"metal_sim: building {what} failed:\n{' '.join(cmd)}\n"
                            f"{r.stderr[-6000:]}")


def _build_once(target: Path, build) -> Path:
    """Run ``build(tmp_path)`` under the lock unless ``target`` exists; then rename into place."""
    if target.exists():
        return target
    with _locked(target.parent):
        if not target.exists():
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp_", suffix=target.suffix)
            os.close(fd)
            try:
                build(Path(tmp))
                os.replace(tmp, target)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
    return target


@lru_cache(maxsize=None)
def runtime_library(cxx: str | None = None) -> Path:
    path, version = find_compiler(cxx)
    target = cache_dir() / f"msim_rt_{_key(version, shim_hash(), 'rt')}.so"
    _build_once(target, lambda tmp: _run(
        [path, "-std=c++20", "-O2", "-fPIC", "-shared", "-pthread", "-I", str(SHIM_DIR),
         str(SHIM_DIR / RUNTIME_SRC), "-o", str(tmp)], "the simulator runtime"))
    return target


@lru_cache(maxsize=None)
def pch_dir(cxx: str | None, opt: str) -> Path:
    """A directory holding ``msl_shim.h.gch`` for these flags (first on the include path)."""
    path, version = find_compiler(cxx)
    d = cache_dir() / f"pch_{_key(version, shim_hash(), opt, *FLAGS)}"
    d.mkdir(exist_ok=True)
    target = d / (SHIM_HEADER + ".gch")
    if "clang" in version:
        return d  # no PCH for clang (the plain header is used)
    _build_once(target, lambda tmp: _run(
        [path, *FLAGS, opt, "-x", "c++-header", "-I", str(SHIM_DIR), "-I",
         str(SHIM_DIR / "include"), str(SHIM_DIR / SHIM_HEADER), "-o", str(tmp)],
        "the precompiled shim header"))
    return d


_loaded: dict[str, ctypes.CDLL] = {}


def compile_kernel(cpp: str, *, cxx: str | None, opt: str, remap) -> tuple[ctypes.CDLL, Path]:
    """Compile (or fetch from the cache) one kernel translation unit; returns (library, .cpp path).

    ``remap(text)`` rewrites ``kernel.metal:N`` locations in diagnostics.
    """
    path, version = find_compiler(cxx)
    rt = runtime_library(cxx)
    key = _key(cpp, version, opt, *FLAGS, shim_hash())
    lib = _loaded.get(key)
    d = cache_dir()
    src = d / f"k_{key}.cpp"
    so = d / f"k_{key}.so"
    if lib is not None:
        return lib, src
    if not so.exists():
        pch = pch_dir(cxx, opt)
        with _locked(d):
            if not so.exists():
                src.write_text(cpp)
                fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp_", suffix=".so")
                os.close(fd)
                try:
                    cmd = [path, *FLAGS, opt, "-shared", "-I", str(pch), "-I", str(SHIM_DIR),
                           "-I", str(SHIM_DIR / "include"), str(src), str(rt),
                           f"-Wl,-rpath,{rt.parent}", "-o", tmp]
                    r = subprocess.run(cmd, capture_output=True, text=True)
                    if r.returncode != 0:
                        raise MetalCompileError(
                            f"metal_sim: the kernel does not compile (C++ file: {src}):\n"
                            + remap(_trim(r.stderr)))
                    os.replace(tmp, so)
                finally:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
    lib = ctypes.CDLL(str(so))
    _loaded[key] = lib
    return lib, src


def _trim(diag: str, limit: int = 8000) -> str:
    lines = [ln for ln in diag.splitlines()
             if "In instantiation of" not in ln or "kernel.metal" in ln]
    text = "\n".join(lines)
    return text if len(text) <= limit else text[:limit] + "\n... (truncated)"
