"""Transfers between ranks over an `mx.distributed` group: a boundary's arrays as one header
and one byte payload (so sender and receiver agree on order whatever the graph), the logits
reduction, and the counts of bytes sent. A lost peer raises `DistributedError` naming it."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from .watchdog import Watchdog

DTYPES = [mx.bfloat16, mx.float32, mx.int32, mx.uint8, mx.float16]
HEADER = 6  # per array: dtype code (-1: absent), ndim, up to 4 dims


class DistributedError(RuntimeError):
    """A rank failed or disagrees (the message names the rank and the cause)."""


BACKEND_ERRORS = ("[ring]", "[jaccl]", "[mpi]")  # how MLX's backends open their errors


def is_backend_error(error: BaseException) -> bool:
    """Whether `error` is an `mx.distributed` backend's (a peer lost, a socket closed)."""
    return isinstance(error, RuntimeError) and str(error).startswith(BACKEND_ERRORS)


class Link:
    """This rank's end of the group; `sent` counts payload + header bytes of boundaries and
    `reduced` the bytes this rank contributes to logits reductions."""

    def __init__(self, group, timeout: float = 900.0):
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.sent = 0
        self.reduced = 0
        self.watchdog = Watchdog(timeout, self.rank)

    def _eval(self, value, peer: Optional[int], what: str):
        try:
            mx.eval(value)
        except RuntimeError as e:
            raise self.lost(e, what, peer) from None
        self.watchdog.beat()
        return value

    def lost(self, error: RuntimeError, what: str, peer: Optional[int] = None):
        """The DistributedError naming the peer (when known) that a failed call lost."""
        peer = self._other() if peer is None else peer
        who = f"rank {peer}" if peer is not None else "a peer"
        return DistributedError(f"rank {self.rank}: lost {who} while {what} ({error})")

    def send_arrays(self, arrays: list, dst: int) -> None:
        header, parts = [], []
        for a in arrays:
            if a is None:
                header += [-1] * HEADER
                continue
            if a.ndim > HEADER - 2:
                raise ValueError(f"cannot send a {a.ndim}-dimensional array")
            header += [DTYPES.index(a.dtype), a.ndim] + list(a.shape) + \
                [0] * (HEADER - 2 - a.ndim)
            parts.append(a.reshape(-1).view(mx.uint8))
        head = mx.array(header, dtype=mx.int32)
        self._eval(mx.distributed.send(head, dst, group=self.group), dst, "sending a header")
        payload = mx.concatenate(parts) if parts else mx.zeros((0,), mx.uint8)
        if payload.size:
            self._eval(mx.distributed.send(payload, dst, group=self.group), dst,
                       "sending activations")
        self.sent += head.nbytes + payload.size

    def recv_arrays(self, count: int, src: int) -> list:
        head = self._eval(mx.distributed.recv((count * HEADER,), mx.int32, src, group=self.group),
                          src, "waiting for a header")
        specs = [head[i * HEADER:(i + 1) * HEADER].tolist() for i in range(count)]
        sizes = [0 if s[0] < 0 else DTYPES[s[0]].size * _prod(s[2:2 + s[1]]) for s in specs]
        total = sum(sizes)
        payload = None
        if total:
            payload = self._eval(mx.distributed.recv((total,), mx.uint8, src, group=self.group),
                                 src, "waiting for activations")
        out, offset = [], 0
        for spec, size in zip(specs, sizes):
            if spec[0] < 0:
                out.append(None)
                continue
            shape = spec[2:2 + spec[1]]
            out.append(payload[offset:offset + size].view(DTYPES[spec[0]]).reshape(shape))
            offset += size
        return out

    def all_sum(self, x: mx.array, what: str) -> mx.array:
        if self.size == 1:
            return x
        self.reduced += x.nbytes
        return self._eval(mx.distributed.all_sum(x, group=self.group), None, what)

    def _other(self) -> Optional[int]:
        """The peer a collective lost: known when there is only one other rank."""
        return 1 - self.rank if self.size == 2 else None

    def reduce(self, x: mx.array) -> mx.array:
        """`all_sum` left lazy, inside the caller's graph (tensor parallel: a few per layer;
        a lost peer then surfaces as MLX's error where the graph is evaluated)."""
        self.reduced += x.nbytes
        return mx.distributed.all_sum(x, group=self.group)

    def all_gather(self, x: mx.array, what: str) -> mx.array:
        """[size * n, ...]: every rank's `x` in rank order."""
        return self._eval(mx.distributed.all_gather(x, group=self.group), None, what)


def _prod(dims) -> int:
    out = 1
    for d in dims:
        out *= int(d)
    return out
