"""One sequence of a continuous batch (`batch.BatchGenerator`): its state between steps,
what a step emits for it (`Response`), its own random stream (`RandomKey`), and the counters of
a generator's work (`BatchStats`)."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable, Optional

import mlx.core as mx

from .speculative import DraftStats, Speculation

MAX_SEED = 2**64 - 1  # mx.random.seed takes an unsigned 64-bit integer


@dataclass
class BatchStats:
    """What a generator did while a `stats()` block ran (mlx-lm's fields)."""

    prompt_tokens: int = 0
    prompt_time: float = 0.0
    generation_tokens: int = 0
    generation_time: float = 0.0
    peak_memory: float = 0.0  # GB, process-wide
    drafts_proposed: int = 0  # with draft="dspark", over all sequences
    drafts_accepted: int = 0

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / max(self.prompt_time, 1e-9)

    @property
    def generation_tps(self) -> float:
        return self.generation_tokens / max(self.generation_time, 1e-9)


@dataclass
class Response:
    """One emitted token of one sequence (`BatchGenerator.next`).

    finish_reason: None while the sequence goes on; "stop" (a stop token), "length"
    (max_tokens or the context) or "error" (`error` says why; no token then, -1).
    prompt_cache: the sequence's cache when it finished (prompt and every emitted token).
    from_draft: the token is a DSpark draft the target accepted; draft_stats: the sequence's
    drafts proposed / accepted so far (with draft="dspark").
    """

    uid: int
    token: int
    logprobs: Optional[mx.array]
    finish_reason: Optional[str] = None
    prompt_cache: Optional[list] = None
    error: Optional[BaseException] = None
    from_draft: bool = False
    draft_stats: Optional[DraftStats] = None


class RandomKey:
    """A sequence's own random stream: sampling with it draws exactly what a batch-1 run
    seeded with `seed` draws (the global key is set to this stream's before each sample and
    taken back after).

    The key a draw leaves is kept as an array and started at once (`mx.async_eval`), not
    read back: it is queued behind the step in flight, so reading it then would wait for
    that step. It is read when the stream draws again (or `seed` is asked), by which time
    the step it was queued behind has ended."""

    def __init__(self, seed: int):
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
            raise ValueError(f"seed must be an int in [0, 2**64 - 1], got {seed!r}")
        self._seed = seed
        self._left: Optional[mx.array] = None  # the key the last draw left, not yet read

    @property
    def seed(self) -> int:
        """The stream's current key as the seed that restores it."""
        if self._left is not None:
            high, low = self._left.tolist()
            self._seed, self._left = (high << 32) | low, None
        return self._seed

    @seed.setter
    def seed(self, value: int) -> None:
        self._seed, self._left = value, None

    @contextmanager
    def active(self):
        mx.random.seed(self.seed)
        try:
            yield
        finally:
            self._left = mx.random.state[0]
            mx.async_eval(self._left)


def random_stream(key: Optional[RandomKey]):
    """The sequence's random stream as the global one (the global one when it has none)."""
    return nullcontext() if key is None else key.active()


@dataclass
class BatchSequence:
    uid: int
    prompt: list
    cache: list
    max_tokens: int
    sampler: Callable
    processors: list
    key: Optional[RandomKey]
    images: object = None
    steps: object = None  # the prefill generator while prefilling
    on_main: bool = False  # its prompt read on the main thread (always without a prompt thread)
    history: Optional[mx.array] = None  # prompt and sampled tokens (for processors)
    token: Optional[mx.array] = None  # sampled, not yet fed
    logprobs: Optional[mx.array] = None
    generated: int = 0
    finish_reason: Optional[str] = None
    prefilled: int = 0  # prompt tokens in the cache so far
    forks: list = field(default_factory=list)  # sequences that branch off once the prompt is in
    spec: Optional[Speculation] = None  # with draft="dspark", once decoding

    def progress(self, done: int, total: int) -> None:
        self.prefilled = done
