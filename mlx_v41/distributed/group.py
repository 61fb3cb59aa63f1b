"""The ranks of a pipeline or tensor-parallel group as generation sees them
(`generation.group.ProcessGroup`): rank 0 prepares each prompt (it alone reads the images); a
pipeline's last rank alone holds the logits, so its sampled token, drafts and acceptance reach
every rank as a few int32s (under tensor parallel every rank computes them alike); a prefill or
a reply is watched for a stuck rank; each rank keeps its own share of a prompt-cache file. A
group model carries its `RankGroup` as `model.group`, which the commands pass to generation.
"""

from __future__ import annotations

import mlx.core as mx

from ..generation.group import ProcessGroup
from .cache_files import exists_on_any_rank, load_across_ranks, save_across_ranks
from .link import Link
from .prompt import prepare_shared_prompt


class RankGroup(ProcessGroup):
    """This rank of a group. `split`: the pipeline's layer ranges, or "tensor parallel xN"
    (what the startup handshake and the prompt-cache files compare)."""

    def __init__(self, link: Link, split, is_pipeline: bool):
        self.link, self.split, self.is_pipeline = link, split, is_pipeline

    @property
    def has_logits(self) -> bool:
        """A pipeline's last rank alone holds the head (the others' logits are zeros)."""
        return not self.is_pipeline or self.link.rank == self.link.size - 1

    @property
    def share(self) -> dict:
        """This rank's place in the group, as its prompt-cache files record it."""
        return {"rank": self.link.rank, "size": self.link.size, "split": self.split}

    def prepare_prompt(self, model, ids, images=None):
        return prepare_shared_prompt(model, ids, images, self)

    def agree_on_token(self, token: mx.array) -> mx.array:
        """The last rank's sampled token on every rank of a pipeline: one int32 per row is
        reduced instead of the logits (every rank still runs the sampler, so their random
        keys stay alike)."""
        if not self.is_pipeline:
            return token
        mine = token.astype(mx.int32) if self.has_logits else mx.zeros(token.shape, mx.int32)
        return self.link.all_sum(mine, "sharing the sampled token").astype(token.dtype)

    def agree_on_ints(self, values: list, size: int) -> list:
        """A pipeline's last rank's ints (at most `size`) on every rank: one all_sum of
        size + 1 int32s."""
        if not self.is_pipeline:
            return list(values)
        mine = [len(values)] + list(values) + [0] * (size - len(values)) if self.has_logits \
            else [0] * (size + 1)
        agreed = self.link.all_sum(mx.array(mine, mx.int32), "sharing the drafts").tolist()
        return agreed[1:1 + agreed[0]]

    def busy(self, what: str):
        return self.link.watchdog.busy(what)

    def save_prompt_cache(self, path, cache: list, model, metadata: dict, stage) -> None:
        save_across_ranks(path, cache, model, metadata, stage, self)

    def load_prompt_cache(self, path, model) -> tuple:
        return load_across_ranks(path, model, self)

    def has_prompt_cache(self, path) -> bool:
        return exists_on_any_rank(path, self.link)
