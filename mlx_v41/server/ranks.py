"""The server across the ranks of a `--pipeline` / `--tensor-parallel` group: rank 0 serves
HTTP, decodes the images, and shares each request's work (ids, image spans' grids, settings,
stop strings, processors' fields, DSpark settings) as one JSON line; the other ranks run the
same prefill and decode, and after every token learn whether the request was cancelled."""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import asdict

import mlx.core as mx

from ..distributed.lines import share_line
from ..distributed.prompt import followed_prompt, leading_prompt, span_grids
from ..generation.api import wired_limit
from .engine import Engine, Finish, Job, Settings
from .processors import processors_from
from .protocol import RequestError

log = logging.getLogger("mlx_v41.server")


class GroupEngine(Engine):
    """Rank 0's engine: an `Engine` that shares each request and each cancel with the ranks
    that `follow`. Prompt reuse is off (each rank's store would evict by its own share's
    bytes, so the ranks could reuse different prefixes)."""

    def __init__(self, model, tokenizer, store, **options):
        super().__init__(model, tokenizer, store, **options)
        self.link = model.link
        self.is_pipeline = hasattr(model, "stage")

    def submit(self, prompt, settings: Settings) -> Job:
        if settings.logprobs is not None and self.is_pipeline:
            raise RequestError("logprobs are not available under --pipeline (rank 0 does not "
                               "hold the logits)", param="logprobs")
        return super().submit(prompt, settings)

    def _run(self, job: Job) -> Finish:
        share_line(self.link, json.dumps({**work_record(job), "draft": self.draft}))
        job.prompt = leading_prompt(self.model, job.prompt)  # the tower's rows for the others
        return super()._run(job)

    def _is_cancelled(self, job: Job) -> bool:
        return share_flag(self.link, job.cancelled.is_set())

    def _stopped(self) -> None:
        try:
            share_line(self.link, None)
        except Exception:  # the other ranks already left (e.g. Ctrl-C reached them too)
            log.warning("the other ranks were not told that the server stopped")


class Follower(Engine):
    """The engine of a rank other than 0: no HTTP, no queue; `follow` runs rank 0's work."""

    def __init__(self, model, tokenizer, store, **options):
        super().__init__(model, tokenizer, store, **options)
        self.link = model.link

    def _is_cancelled(self, job: Job) -> bool:
        return share_flag(self.link, False)

    def follow(self) -> None:
        """Run rank 0's requests until it stops."""
        while (line := share_line(self.link, None)) is not None:
            record = json.loads(line)
            self.draft = record["draft"]  # rank 0's: every rank runs the same decoding loop
            job = FollowerJob(record, self.model, self.tokenizer)
            try:
                with wired_limit(self.model):
                    self._run(job)
            except Exception:  # rank 0 fails the same way and its server goes on
                log.exception("request failed")


def work_record(job: Job) -> dict:
    settings = {k: v for k, v in asdict(job.settings).items() if k != "processors"}
    return {"ids": list(job.prompt.ids), "spans": span_grids(job.prompt), "settings": settings}


class FollowerJob(Job):
    """Rank 0's request on another rank: no event loop, its tokens go nowhere."""

    def __init__(self, record: dict, model, tokenizer):
        settings = Settings(**record["settings"])
        settings.processors = processors_from(settings.processor_fields, tokenizer)
        self.prompt = followed_prompt(model, record["ids"], record["spans"])
        self.settings = settings
        self.cancelled, self.finish = threading.Event(), None

    def put(self, item) -> None:
        pass


def share_flag(link, flag: bool) -> bool:
    """Rank 0's `flag` on every rank (the others' is ignored)."""
    mine = mx.array([int(flag) if link.rank == 0 else 0], mx.int32)
    return bool(link.all_sum(mine, "sharing a request's cancel").item())
