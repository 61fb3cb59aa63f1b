"""Starting a pipeline: join the group, load this rank's share, then one handshake in which
every rank learns whether every other loaded, and the same checkpoint: a rank that could not
load, or that holds other weights or another config, ends every rank with one line naming it.
Joining and the handshake run under a deadline, so a rank that never answers ends the others
too instead of leaving them waiting."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

from .link import DistributedError, Link

TIMEOUT_ENV = "MLX_V41_DISTRIBUTED_TIMEOUT"
DEFAULT_TIMEOUT = 900.0  # s: loading a 300 GB share from disk can take minutes
RECORD_BYTES = 1024


def startup_timeout(timeout: Optional[float] = None) -> float:
    if timeout is not None:
        return float(timeout)
    value = os.environ.get(TIMEOUT_ENV)
    try:
        return float(value) if value else DEFAULT_TIMEOUT
    except ValueError:
        raise DistributedError(f"{TIMEOUT_ENV}={value!r}: expected seconds") from None


@contextmanager
def deadline(seconds: float, message: str):
    """End this process with `message` (one line on stderr) unless the block finishes within
    `seconds`: a distributed call blocked on a silent peer cannot be interrupted otherwise."""
    def expire():
        print(message, file=sys.stderr, flush=True)
        os._exit(1)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def join_group(timeout: Optional[float] = None, switch: str = "--pipeline") -> Link:
    """The launched group (mlx.launch sets the backend and ranks up)."""
    seconds = startup_timeout(timeout)
    with deadline(seconds, f"mlx_v41 {switch[2:]}: the other ranks did not connect within "
                           f"{seconds:g} s ({TIMEOUT_ENV})"):
        group = mx.distributed.init()
    if group.size() < 2:
        raise DistributedError(f"{switch} needs two or more processes: start them with "
                               "mlx.launch -n 2 --python $(which python) -- ... (or --hosts)")
    return Link(group, seconds)


def _record(folder: Path, model, error: Optional[str]) -> dict:
    if error is not None:
        return {"error": error}
    config = hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()
    return {"weights": model.weights_fingerprint, "config": config, "ranges": model.ranges}


def handshake(link: Link, record: dict, seconds: float) -> None:
    """Exchange every rank's record; raise the first disagreement (the same on every rank)."""
    data = json.dumps(record).encode()[:RECORD_BYTES]
    mine = np.zeros(RECORD_BYTES, np.uint8)
    mine[:len(data)] = np.frombuffer(data, np.uint8)
    with deadline(seconds, f"mlx_v41 pipeline: rank {link.rank}: no answer from the other ranks "
                           f"within {seconds:g} s of loading (a rank died or is stuck; "
                           f"{TIMEOUT_ENV})"):
        everyone = np.array(link.all_gather(mx.array(mine), "exchanging the startup records"))
    records = []
    for rank, row in enumerate(everyone.reshape(link.size, RECORD_BYTES)):
        text = bytes(row).rstrip(b"\0").decode(errors="replace")
        try:
            records.append(json.loads(text))
        except json.JSONDecodeError:
            records.append({"error": text[:200] + " (record truncated)"})
    for rank, r in enumerate(records):
        if "error" in r:
            raise DistributedError(f"rank {rank} could not load its model: {r['error']}")
    for field, what in (("config", "config.json"), ("weights", "weights"),
                        ("ranges", "layer split")):
        for rank, r in enumerate(records[1:], 1):
            if r[field] != records[0][field]:
                raise DistributedError(
                    f"rank {rank}'s {what} differ from rank 0's ({_short(r[field])} vs "
                    f"{_short(records[0][field])}): every rank needs the same checkpoint")


def _short(value) -> str:
    return value[:12] if isinstance(value, str) else str(value)


def start_pipeline(path, split: Optional[str] = None, timeout: Optional[float] = None,
                   **options):
    """Join the group, load this rank's share of the folder at `path` (its own local copy) and
    check with the others -> (PipelineModel, tokenizer). Any rank failing raises the same
    DistributedError on every rank."""
    from .pipeline import load_pipeline

    link = join_group(timeout)
    return _start(link, path, lambda folder: load_pipeline(folder, link, split, **options),
                  timeout)


def start_tensor_parallel(path, timeout: Optional[float] = None, **options):
    """`start_pipeline` for tensor parallel -> (TensorParallelModel, tokenizer)."""
    from .tensor import load_tensor_parallel

    link = join_group(timeout, "--tensor-parallel")
    return _start(link, path, lambda folder: load_tensor_parallel(folder, link, **options),
                  timeout)


def _start(link: Link, path, load, timeout: Optional[float]):
    from ..checkpoint.source import resolve_model_path

    model = tokenizer = error = None
    folder = Path(path)
    try:
        folder = resolve_model_path(path)
        model, tokenizer = load(folder)
    except Exception as e:  # reported to every rank by the handshake, then raised there
        error = f"{type(e).__name__}: {e}".splitlines()[0][:400]
    handshake(link, _record(folder, model, error), startup_timeout(timeout))
    return model, tokenizer
