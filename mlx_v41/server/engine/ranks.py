"""The server across the ranks of a `--pipeline` / `--tensor-parallel` group: rank 0 serves
HTTP, decodes the images, and shares each request's work (ids, image spans' grids and
records, settings, stop strings, processors' fields, DSpark settings, the cached prefix its
store chose) as one JSON line, then a cancel flag per token and its store's decisions after
the request; the other ranks follow, their stores applying those decisions to their own shares
of the caches."""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import asdict

import mlx.core as mx

from ...distributed.lines import IdleWait, share_line
from ...distributed.link import DistributedError
from ...distributed.prompt import followed_prompt, leading_prompt, span_grids
from ...generation.api import wired_limit
from .serial import Engine, Finish, Job, Settings
from ..processors import processors_from
from .prompt_store import StoreMismatch, largest_shares
from ..errors import RequestError

log = logging.getLogger("mlx_v41.server")


class RankEngine(Engine):
    """An engine on one rank of a group: the prefix it reuses is rank 0's choice (`job.reuse`),
    and the caches a request leaves are kept or dropped as rank 0's store decides."""

    def __init__(self, model, tokenizer, store, **options):
        super().__init__(model, tokenizer, store, **options)
        self.link = self.group.link  # the model's `RankGroup`
        self.label = f"rank {self.link.rank}: "
        self.idle = IdleWait(self.link)  # between requests the other ranks sleep

    def _reuse(self, job: Job):
        return job.reuse

    def _keep(self, states: list) -> None:
        """Rank 0 admits each state counted at its largest share over the ranks (so no rank's
        store passes the byte bound) and shares its decisions; every rank applies them."""
        sizes = largest_shares(self.link, states)
        if self.link.rank == 0:
            decisions = []
            for state, size in zip(states, sizes):
                decisions.append(None if size is None else self.store.admit(state, size))
                if decisions[-1] is not None:
                    self.store.apply(state, decisions[-1])
            share_line(self.link, json.dumps(decisions))
            return
        decisions = json.loads(share_line(self.link, None))
        for state, decision in zip(states, decisions):
            if decision is not None:
                self.store.apply(state, decision)


class GroupEngine(RankEngine):
    """Rank 0's engine: an `Engine` that shares each request (with the prefix its store chose)
    and each cancel with the ranks that `follow`."""

    def __init__(self, model, tokenizer, store, **options):
        super().__init__(model, tokenizer, store, **options)
        self.is_pipeline = self.group.is_pipeline
        self._has_run = False  # a request ran since the last write of new cache files
        self._lost = False  # a tick between requests lost a rank: wait without ticking

    def submit(self, prompt, settings: Settings) -> Job:
        if settings.logprobs is not None and self.is_pipeline:
            raise RequestError("logprobs are not available under --pipeline (rank 0 does not "
                               "hold the logits)", param="logprobs")
        return super().submit(prompt, settings)

    def _next_job(self):
        if self._lost:
            return super()._next_job()
        try:
            return self.idle.wait(lambda timeout: self._queue.get(timeout=timeout))
        except DistributedError as e:  # a rank was lost between requests: from here each
            log.error("%s", e)         # request fails alone, as one that lost it would
            self._lost = True
            return super()._next_job()

    def _run(self, job: Job) -> Finish:
        self._has_run = True
        job.reuse = self.store.choose(job.prompt.ids, job.prompt.records())
        self.idle.share(json.dumps({**work_record(job), "draft": self.draft}))
        job.prompt = leading_prompt(self.group, job.prompt)  # the tower's rows for the others
        return super()._run(job)

    def _is_cancelled(self, job: Job) -> bool:
        return share_flag(self.link, job.cancelled.is_set())

    def _flush(self) -> None:
        """The ranks write new cache files together, once after each request that ran (as the
        followers do), never for one that was cancelled before it started."""
        if self._has_run:
            self._has_run = False
            super()._flush()

    def _stopped(self) -> None:
        try:
            share_line(self.link, None)
        except Exception:  # the other ranks already left (e.g. Ctrl-C reached them too)
            log.warning("the other ranks were not told that the server stopped")


class Follower(RankEngine):
    """The engine of a rank other than 0: no HTTP, no queue; `follow` runs rank 0's work."""

    def _is_cancelled(self, job: Job) -> bool:
        return share_flag(self.link, False)

    def follow(self) -> None:
        """Load the persisted prompt caches with rank 0, then run its requests until it
        stops (writing new cache files with it after each)."""
        self.store.load_folder()
        while (line := self.idle.line()) is not None:
            record = json.loads(line)
            self.draft = record["draft"]  # rank 0's: every rank runs the same decoding loop
            job = FollowerJob(record, self.group, self.tokenizer)
            try:
                with wired_limit(self.model):
                    self._run(job)
            except DistributedError:
                raise
            except StoreMismatch as e:  # the ranks would part ways: end them all
                raise DistributedError(f"rank {self.link.rank}: {e}") from None
            except Exception:  # rank 0 fails the same way and its server goes on
                log.exception("request failed")
            self._flush()


def work_record(job: Job) -> dict:
    settings = {k: v for k, v in asdict(job.settings).items() if k != "processors"}
    return {"ids": list(job.prompt.ids), "spans": span_grids(job.prompt),
            "records": job.prompt.records(), "settings": settings, "reuse": job.reuse}


class FollowerJob(Job):
    """Rank 0's request on another rank: no event loop, its tokens go nowhere."""

    def __init__(self, record: dict, group, tokenizer):
        settings = Settings(**record["settings"])
        settings.processors = processors_from(settings.processor_fields, tokenizer)
        # rank 0's records: the followers' cache entries are stored (and their files named)
        # as rank 0's are
        self.prompt = followed_prompt(group, record["ids"], record["spans"], record["records"])
        self.settings = settings
        self.reuse = record["reuse"]
        self.cancelled, self.finish = threading.Event(), None

    def put(self, item) -> None:
        pass


def share_flag(link, flag: bool) -> bool:
    """Rank 0's `flag` on every rank (the others' is ignored)."""
    mine = mx.array([int(flag) if link.rank == 0 else 0], mx.int32)
    return bool(link.all_sum(mine, "sharing a request's cancel").item())

