"""Shared fixtures: the reference goldens copied into tests/data/goldens (see its README), the
tiny golden model (`tiny_model`, `tiny_ops`), MLX's CPU backend for a module (`cpu`)."""

from __future__ import annotations

import json
import random
import shutil
import socket
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_v41
from mlx_v41.kernels import Kernels
from mlx_v41.numerics.rope import shared_rope

DATA = Path(__file__).parent / "data"
GOLDENS = DATA / "goldens"


def golden_checkpoint(name: str) -> Path:
    """`grow` runs the `tiny` weights, so it has no checkpoint copy of its own."""
    return GOLDENS / ("tiny" if name == "grow" else name) / "hf"


def writable_copy(source: Path, folder: Path) -> Path:
    """A writable copy of a checkpoint folder (copyfile: the golden files are read-only)."""
    shutil.copytree(source, folder, copy_function=shutil.copyfile)
    folder.chmod(0o755)
    return folder


def with_context(folder: Path, positions: int) -> Path:
    """Set `max_position_embeddings` of a writable checkpoint copy."""
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = positions
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def slow(*values):
    """A parametrize case marked slow: the full suite runs it, the fast lane
    (`-m "not slow"`) does not."""
    return pytest.param(*values, marks=pytest.mark.slow)


# Ranks started by tests run at a lower priority. MLX's ring backend waits for a peer by polling
# its socket (a core busy for as long as it waits), so a pipeline's or a tensor-parallel group's
# ranks on one machine keep both cores busy while most of them only wait; at the same priority
# that took the cores from the suite's other worker (a test beside them ran twice as long).
# Lowered, the polling gets only what the other worker leaves.
RANK_PRIORITY = ["nice", "-n", "10"]
# Groups are started with `mlx_v41.launch` (mlx.launch whose loops wait; mlx.launch's own keep
# 1.3-1.4 cores busy for as long as its ranks run: docs/distributed.md). tests/test_launch.py
# compares the two.
LAUNCHER = [sys.executable, "-m", "mlx_v41.launch"]


def free_port_run(n: int) -> int:
    """The first of n free consecutive ports, below the system's ephemeral range: a port that
    is free when checked can still be taken before the rank binds it, and outgoing connections
    (the other worker's HTTP clients, hundreds a second) take ephemeral ones."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 49152  # IANA's dynamic range, macOS's default
    for _ in range(200):
        base = random.randint(20000, max(low, 20000 + 1000) - n)
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {n} free consecutive ports for a launcher")


def mlx_launch(n: int, launcher=LAUNCHER) -> list:
    """`launcher -n N` (mlx.launch's arguments) on a free run of N ports (the ring listens on
    starting-port + rank), so two test runs on one machine never join each other's rings (the
    default port is fixed), at `RANK_PRIORITY`."""
    return [*RANK_PRIORITY, *launcher, "-n", str(n), "--starting-port", str(free_port_run(n)),
            "--python", sys.executable, "--"]


@pytest.fixture
def ckpt(tmp_path) -> Path:
    """A writable copy of the tiny golden checkpoint."""
    return writable_copy(golden_checkpoint("tiny"), tmp_path / "hf")


@pytest.fixture(scope="session")
def tiny_model():
    """A factory of tiny golden models, a fresh one per call: `tiny_model(kernels)` with those
    `Kernels` (`Kernels(use=False)`: the reference ops), `tiny_model()` with the default ones;
    keyword arguments go to `mlx_v41.load_model` (`dspark=True`, `prefill_mode=...`)."""
    def load(kernels: Kernels | None = None, **kwargs):
        model = mlx_v41.load_model(golden_checkpoint("tiny"), **kwargs)
        if kernels is not None:
            model.kernels = kernels
        return model
    return load


@pytest.fixture(scope="module")
def tiny_ops(tiny_model):
    """One tiny golden model on the reference ops for a whole test module (not to be changed
    by a test: the module's other tests share it)."""
    return tiny_model(Kernels(use=False))


@pytest.fixture(scope="module")
def cpu():
    """MLX's CPU backend for a whole test module (`pytestmark = pytest.mark.usefixtures("cpu")`).

    For exact equalities between different computations of one value (chunked == one call, batch
    of 2 == two of 1, our bits == the goldens' CPU reference where no ulp event has happened):
    they rest on the CPU kernels summing identically across shapes, which Metal's do not promise.
    The shared RoPE tables are rebuilt so none computed on the GPU by an earlier module is used.
    Models in such a module run the reference ops (`reference_ops`).
    """
    previous = mx.default_device()
    mx.set_default_device(mx.cpu)
    shared_rope.cache_clear()
    yield
    shared_rope.cache_clear()
    mx.set_default_device(previous)


def reference_ops(model):
    """`model` on the reference ops, for a CPU-pinned test: a Metal kernel only runs on the GPU
    (and equals its ops to a tolerance, not bit for bit). Without Metal the ops run anyway."""
    model.kernels = Kernels(use=False)
    return model


def packed_state(cache) -> list:
    """Every committed byte a later call can read: compressed rows, open groups, the windows."""
    out = []
    for c in cache:
        if c.compressed is not None:
            kv = c.compressed
            out += [kv.kv[:, :kv.count], kv.index_k[:, :kv.count]]
            out += list(kv.pending) if kv.pending else []
        if c.offset > 1:
            out.append(c.window.recent(c.offset))
    return out


class Golden:
    def __init__(self, name: str):
        self.name = name
        self.root = GOLDENS / name
        self.hf = golden_checkpoint(name)
        self.prompt = mx.load(str(self.root / "prefill/inputs.safetensors"))["prompt_ids"]
        self.prefill = mx.load(str(self.root / "prefill/outputs.safetensors"))
        self.reference = mx.load(str(self.root / "reference.safetensors"))

    def decode(self, mode: str, key: str) -> mx.array:
        return self.reference[f"decode_{mode}.{key}"]

    def step(self, mode: str, step: int, key: str) -> mx.array:
        return self.reference[f"decode_{mode}.{step:03d}.{key}"]


@pytest.fixture(scope="session")
def goldens():
    cache = {}

    def get(name: str) -> Golden:
        if name not in cache:
            cache[name] = Golden(name)
        return cache[name]

    return get


CORPUS_WORDS = "the quick brown fox jumps over a lazy dog while seven wizards box jam".split()


PLAN_LINES = ("experts: resident (", "experts: streamed from SSD")


def without_plan(text: str) -> str:
    """A command's stderr without the line saying whether the experts are resident or
    streamed (every command that loads a model prints it)."""
    return "".join(line for line in text.splitlines(keepends=True)
                   if not line.startswith(PLAN_LINES))


def corpus(path, documents: int = 12, words: int = 30):
    """A jsonl file of `documents` texts of `words` random words (seeded): data for the
    perplexity and compare tests."""
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for _ in range(documents):
            f.write(json.dumps({"text": " ".join(rng.choice(CORPUS_WORDS, words))}) + "\n")
    return path
