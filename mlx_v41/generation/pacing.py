"""How much prompt a batch step reads while sequences decode (Sarathi-Serve's stall-free
batching): `PrefillPacer` keeps running means of the decode step's time and the prompts'
seconds per token and turns them into a token budget, so a reply's token gap stays about two
decode steps while a long prompt is read.
"""

from __future__ import annotations

from typing import Optional

PREFILL_SHARE = 1.0  # auto budget: a step's prompt seconds per second of its decode step
MIN_PREFILL_CHUNK = 32  # auto budget floor (tokens): below it a chunk's fixed costs show
EMA_WEIGHT = 0.25  # weight of a step's measurement in the pacer's running means


class PrefillPacer:
    """The prompt work a step may do while sequences decode, in prompt tokens (a CED halo
    layer counts its rows over the encoder layers, `prefill.Pace`): a fixed budget, or
    "auto": one decode step's time at the prompts' measured seconds per token (running means
    of both), within [min_chunk, max_chunk], so a reply's token gap stays about two decode
    steps while a long prompt is read."""

    def __init__(self, budget, min_chunk: int, max_chunk: int):
        self.fixed = None if budget == "auto" else budget
        self.min_chunk, self.max_chunk = min(min_chunk, max_chunk), max_chunk
        self.decode_seconds: Optional[float] = None
        self.prompt_seconds: Optional[float] = None  # per step, with `prompt_tokens`
        self.prompt_tokens: Optional[float] = None

    def budget(self) -> float:
        if self.fixed is not None:
            return self.fixed
        if self.decode_seconds is None or not self.prompt_tokens:
            return self.min_chunk  # nothing measured yet: the smallest chunk
        tokens = PREFILL_SHARE * self.decode_seconds * self.prompt_tokens / self.prompt_seconds
        return float(min(max(int(tokens), self.min_chunk), self.max_chunk))

    def decoded(self, seconds: float) -> None:
        self.decode_seconds = _mean(self.decode_seconds, seconds)

    def prefilled(self, tokens: float, seconds: float) -> None:
        if tokens > 0:  # a cost-weighted rate: small pieces do not swing it
            self.prompt_tokens = _mean(self.prompt_tokens, tokens)
            self.prompt_seconds = _mean(self.prompt_seconds, seconds)


def _mean(mean: Optional[float], value: float) -> float:
    return value if mean is None else (1 - EMA_WEIGHT) * mean + EMA_WEIGHT * value
