"""Pipeline parallel inference: each rank holds a contiguous range of layers and runs the same
calls; where the layers pass from one rank to the next, the residual streams, `pre` and exactly
the shared state the later layers read (new packed rows and index keys of earlier kv owners, top-k
selections, candidate pools; `split.crossing`) are sent, with the image mask of the call's
positions (one byte each; None without images), which the later layers' MoE routers (`bias_vl`)
and Engram read: the vision tower runs on rank 0 alone, which merges its rows into the
embeddings, and the later ranks are called without images. Layers of other ranks are
`RemoteBlock`s, and the rows they would compute are *ghosts*: arrays of the right batch and
row count with an empty feature axis, so the prefill strategies (`model/prefill.py`) run
unchanged on every rank. Later ranks keep a mirror of the kv owners they read
(`MirrorKV`). Only the last rank holds logits (the others: zeros); it samples, and its token
reaches every rank by `all_sum` of one int32 (`RankGroup.agree_on_token`; the same seed on
every rank, so the random keys advance alike). Exact: every layer runs the ops it runs in one
process. With the DSpark drafter, the drafter is the last rank's: the other ranks send it the
taps of the target layers they run (`PipelineRun.write_draft_rings`), and its drafts and
acceptance (greedy or sampled: count accepted, next token) reach every rank as a few int32s
(`RankGroup.agree_on_ints`), so every rank verifies and trims alike; each sampled cycle takes
one key on every rank.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from ..cache.layer import CacheError, CompressedKV, LayerCache
from ..checkpoint.placement import Placement
from ..model.model import Block, Model
from ..model.prefill import Run, run_forward
from .group import RankGroup
from .link import Link
from .split import balanced_split, crossing, parse_split


def ghost(batch: int, rows: int, hc: int):
    """Stand-ins for another rank's streams [B, rows, hc, 0] and `pre` [B, rows, hc]."""
    return (mx.zeros((batch, rows, hc, 0), mx.bfloat16),
            mx.zeros((batch, rows, hc), mx.float32))


def is_ghost(streams: mx.array) -> bool:
    return streams.shape[-1] == 0


class Stage:
    """This rank's layers and its boundaries with its neighbours."""

    def __init__(self, link: Link, ranges: list, roles, cfg):
        self.link, self.ranges, self.rank = link, ranges, link.rank
        self.roles, self.hc = roles, cfg.hc_mult
        n = cfg.num_hidden_layers
        self.owner = [r for r, (a, b) in enumerate(ranges) for _ in range(a, b)]
        self.crossings = {a: crossing(roles, n, a, cfg.candidate_source_layer_id)
                          for a, _ in ranges[1:]}
        start = ranges[self.rank][0]
        self.mirrors = set(self.crossings[start].owners) if start else set()
        self.hashes = any(self.owns(e) for e in cfg.engram_layer_ids)
        self.ratios = cfg.compress_ratios
        self.delivered, self.start = {}, 0
        self.chunk, self.hashing, self.masks = None, None, []

    def begin_chunk(self, state, hashing=None) -> None:
        """A chunk's state on a later rank: its image mask arrives with its rows; `hashing`
        (Engram rows of the chunk, given the mask) runs then."""
        self.chunk, self.hashing = state, hashing

    def call_mask(self) -> Optional[mx.array]:
        """A later rank's image mask of the whole call so far, from its chunks' (None: none)."""
        if all(m is None for _, m in self.masks):
            return None
        return mx.concatenate([mx.zeros((1, n), mx.bool_) if m is None else m
                               for n, m in self.masks], axis=1)

    def owns(self, slot: int) -> bool:
        return self.owner[slot] == self.rank

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.link.size - 1

    def begin(self, start: int) -> None:
        """A new call at position `start`: every mirror holds the rows of `start` tokens."""
        self.delivered, self.start = {}, start
        self.chunk, self.hashing, self.masks = None, None, []

    def cross(self, slot: int, streams, pre, state):
        """Hand the rows entering `slot` from the rank holding them to the rank owning it."""
        if slot == 0 or slot not in self.crossings:
            return streams, pre
        src, dst = self.owner[slot - 1], self.owner[slot]
        if self.rank == src and not is_ghost(streams):
            self._send(self.crossings[slot], streams, pre, state, dst)
            return ghost(streams.shape[0], streams.shape[1], self.hc)
        if self.rank == dst and is_ghost(streams):
            return self._receive(self.crossings[slot], state, src)
        return streams, pre

    def _send(self, plan, streams, pre, state, dst: int) -> None:
        arrays = [streams, pre]
        for owner in plan.owners:
            store = state.shared[owner].store
            have = self.delivered.get((plan.slot, owner), self.start // self.ratios[owner])
            new = store.count > have
            arrays += [store.kv[:, have:store.count] if new else None,
                       store.index_k[:, have:store.count] if new else None]
            self.delivered[(plan.slot, owner)] = store.count
        arrays += [state.shared[k].selections.get(t) for k, t in plan.selections]
        arrays += [None if state.shared[k].pool is None else state.shared[k].pool.astype(mx.uint8)
                   for k in plan.pools]
        arrays.append(None if state.image_mask is None else state.image_mask.astype(mx.uint8))
        self.link.send_arrays(arrays, dst)

    def _receive(self, plan, state, src: int):
        count = 3 + 2 * len(plan.owners) + len(plan.selections) + len(plan.pools)
        arrays = self.link.recv_arrays(count, src)
        streams, pre, rest = arrays[0], arrays[1], arrays[2:-1]
        state.image_mask = None if arrays[-1] is None else arrays[-1].astype(mx.bool_)
        if state is self.chunk:
            self.masks.append((state.end - state.start, state.image_mask))
            if self.hashing is not None:
                state.engram_rows = self.hashing(state.image_mask)
            self.chunk, self.hashing = None, None
        for i, owner in enumerate(plan.owners):
            kv, ik = rest[2 * i], rest[2 * i + 1]
            if kv is not None:
                state.shared[owner].store.append_packed(kv, ik)
        rest = rest[2 * len(plan.owners):]
        for (k, t), value in zip(plan.selections, rest):
            if value is not None:
                state.shared[k].selections[t] = value
        for k, value in zip(plan.pools, rest[len(plan.selections):]):
            if value is not None:
                state.shared[k].pool = value.astype(mx.bool_)
        return streams, pre


NO_FEATURES = mx.zeros((0,), mx.float32)  # a weight for rows with no features


class RemoteNorm(nn.Module):
    """The final norm on a rank before the last: the rows reaching it are ghosts (no
    features), so it normalises nothing and holds no parameter to load."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    @property
    def weight(self) -> mx.array:
        return NO_FEATURES


class RemoteBlock(nn.Module):
    """A layer another rank runs: hands real rows over where the ranks change, passes ghosts."""

    def __init__(self, role, stage: Stage):
        super().__init__()
        self.role, self.stage = role, stage

    def __call__(self, streams, pre_in, state, cache, n_out: Optional[int] = None,
                 mixes=None, hand_to=None):
        streams, pre_in = self.stage.cross(self.role.layer, streams, pre_in, state)
        if not is_ghost(streams):
            raise RuntimeError(f"rank {self.stage.rank} holds the rows entering layer "
                               f"{self.role.layer}, which it does not run")
        n_in = streams.shape[1]
        n_out = n_in if n_out is None else n_out
        return streams[:, n_in - n_out:], pre_in[:, n_in - n_out:], None

    def takes_mixes(self, state) -> bool:
        return False  # another rank makes them


class ReceivingBlock(Block):
    """This rank's first layer: receives its input rows from the rank before."""

    def __call__(self, streams, pre_in, state, cache, n_out: Optional[int] = None,
                 mixes=None, hand_to=None):
        streams, pre_in = self.stage.cross(self.role.layer, streams, pre_in, state)
        return super().__call__(streams, pre_in, state, cache, n_out, None, hand_to)

    def takes_mixes(self, state) -> bool:
        return False  # its input rows arrive from another rank


class MirrorKV(CompressedKV):
    """Another rank's kv owner as this rank's readers see it: packed rows only."""

    def __init__(self, ratio: int):
        super().__init__(ratio, 0)

    def rewind(self, position: int) -> None:
        self.count = min(self.count, position // self.ratio)


class RemoteCache(LayerCache):
    """The cache slot of another rank's layer: empty, or a mirror of a kv owner this rank's
    layers (or later ranks') read. Its rollback is the owning rank's (ranks agree on the
    model's budget after every call, `PipelineModel.forward`)."""

    def __init__(self, window: int, ratio: int, mirrored: bool, has_engram: bool):
        super().__init__(window, ratio, False, has_engram)
        if mirrored:
            self.compressed = MirrorKV(ratio)

    def exact_limit(self) -> int:
        return self.offset

    def check(self, layer: int) -> None:
        kv = self.compressed
        if kv is not None and kv.count != self.offset // kv.ratio:
            raise CacheError(f"layer {layer}: the mirrored compressed row count is {kv.count} "
                             f"but the cache offset is {self.offset}")


class PipelineRun(Run):
    """`Run` on one stage: embeddings (and the image rows) on rank 0, Engram rows where its
    layers are (on a later rank once the chunk's image mask arrived), the rows entering the
    first decoder layer handed to its rank (its compressor reads them)."""

    def __init__(self, model, cache, start, *args):
        super().__init__(model, cache, start, *args)
        self.stage = model.stage
        self.stage.begin(start)
        self._mask = None

    @property
    def image_mask(self):
        """The call's image mask: rank 0's own; a later rank's from its chunks' rows."""
        return self._mask if self.stage.first else self.stage.call_mask()

    @image_mask.setter
    def image_mask(self, value) -> None:
        self._mask = value

    def encode(self, chunk, start: int):
        state, streams, pre = super().encode(chunk, start)
        if self.text.decoder_start < len(self.text.layers):
            streams, pre = self.stage.cross(self.text.decoder_start, streams, pre, state)
        return state, streams, pre

    def embed(self, chunk, state):
        """Rank 0 embeds; a later rank's rows arrive at its first layer (ghosts until then),
        and its Engram rows are hashed once the chunk's image mask came with them."""
        if self.stage.first:
            return super().embed(chunk, state)
        self.stage.begin_chunk(state, partial(self.hash_engram, chunk.ids)
                               if self.stage.hashes else None)
        return ghost(chunk.ids.shape[0], chunk.ids.shape[1], self.text.hc_mult)

    def hash_engram(self, ids, image_mask):
        """Only where this rank runs an Engram layer."""
        return super().hash_engram(ids, image_mask) if self.stage.hashes else None

    def write_draft_rings(self, taps: dict, end: int) -> None:
        """Every rank sends the taps of the target layers it runs to the last rank, which
        writes the drafter's rings (the other ranks' ring slots only keep the offsets)."""
        stage, link, last = self.stage, self.stage.link, self.stage.link.size - 1
        for rank in range(last):
            mine = [layer for layer in self.model.cfg.dspark_target_layer_ids
                    if stage.owner[layer] == rank]
            if not mine:
                continue
            if stage.rank == rank:
                link.send_arrays([taps[layer] for layer in mine], last)
            elif stage.last:
                taps = dict(taps)
                taps.update(zip(mine, link.recv_arrays(len(mine), rank)))
        if stage.last:
            super().write_draft_rings(taps, end)

    def precompress(self, state, streams, pre) -> None:
        if self.stage.owns(self.text.decoder_start):
            super().precompress(state, streams, pre)


class PipelineModel(Model):
    """A `Model` holding one rank's share: build with `load_pipeline` (or `load_model(...,
    placement=PipelinePlacement(link, split))`); calls and caches as `Model`'s, run by every
    rank together."""

    def __init__(self, args, link: Link, split: Optional[str] = None, **options):
        # The vision tower (vision.*, aligner.*, image_*) lives on rank 0, with the embedding.
        options["vision"] = bool(options.get("vision")) and link.rank == 0
        super().__init__(args, **options)
        n = self.cfg.num_hidden_layers
        ranges = parse_split(split, n, link.size) if split not in (None, "auto") \
            else balanced_split(self, link.size)
        self.ranges = ranges
        self.stage = Stage(link, ranges, self.roles, self.cfg)
        self.group = RankGroup(link, ranges, is_pipeline=True)  # what generation is given
        self._drafting = bool(options.get("dspark"))
        self._prune()

    @property
    def link(self) -> Link:
        return self.stage.link

    def _prune(self) -> None:
        text, stage = self.model, self.stage
        for i, role in enumerate(self.roles[:self.cfg.num_hidden_layers]):
            if not stage.owns(i):
                text.layers[i] = RemoteBlock(role, stage)
            elif i == self.ranges[stage.rank][0] and i > 0:
                # The built block becomes a receiving one: no new weights drawn, so the random
                # key stays the one a single process holds after loading (same samples).
                text.layers[i].__class__ = ReceivingBlock
                text.layers[i].stage = stage
        if not (stage.first or (stage.last and self._drafting)):  # the drafter embeds too
            text.pop("embed_tokens")
        if not stage.last:
            text.norm = RemoteNorm(text.norm.eps)
            self.pop("lm_head")
            if self._drafting:
                self.pop("dspark")

    @property
    def drafting(self) -> bool:
        return self._drafting

    def make_cache(self) -> list:
        cfg, stage = self.cfg, self.stage
        return [LayerCache(cfg.sliding_window, role.ratio, role.mode == "full",
                           role.engram_index is not None) if stage.owns(i) else
                RemoteCache(cfg.sliding_window, role.ratio, i in stage.mirrors,
                            role.engram_index is not None)
                for i, role in enumerate(self.roles[:cfg.num_hidden_layers])] + \
            [LayerCache(cfg.sliding_window + 1) if stage.last else
             RemoteCache(cfg.sliding_window + 1, 0, False, False)
             for _ in range(cfg.num_nextn_predict_layers if self._drafting else 0)]

    def forward(self, ids, cache: Optional[list] = None, *, last_only: bool = False,
                step_size: Optional[int] = None, input_embeddings=None, taps: tuple = (),
                teacher=None, capture=None, progress=None, images=None):
        if taps or teacher is not None:
            raise ValueError("a pipeline forward has no taps or teacher forcing")
        if images is not None and not self.stage.first:
            raise ValueError(f"rank {self.stage.rank} of a pipeline was given images: only rank "
                             "0 runs the vision tower; call the others with images=None (the "
                             "image mask reaches them with the rows)")
        cache = self.make_cache() if cache is None else cache
        out = run_forward(self, ids, cache, last_only=last_only, step_size=step_size,
                          embeddings=input_embeddings, taps=(), teacher=None, capture=capture,
                          progress=progress, images=images, runner=PipelineRun)
        budget = self.stage.link.all_gather(mx.array([cache[0].trim_budget], mx.int32),
                                            "agreeing on the rollback budget")
        for c in cache:
            c.trim_budget = int(mx.min(budget).item())
        return out

    def head(self, hidden: mx.array, last_only: bool) -> mx.array:
        """The logits on the last rank; zeros of their shape on the others (which sample
        alike and then take the last rank's token, `RankGroup.agree_on_token`)."""
        if is_ghost(hidden):
            rows = 1 if last_only else hidden.shape[1]
            return mx.zeros((hidden.shape[0], rows, self.cfg.vocab_size), mx.float32)
        return super().head(hidden, last_only)


class PipelinePlacement(Placement):
    """A pipeline rank's placement: its `PipelineModel`, which reads only the tensors of the
    layers (and heads) it holds."""

    is_partial = True

    def __init__(self, link: Link, split: Optional[str] = None):
        self.link, self.split = link, split

    def build(self, args, **options):
        return PipelineModel(args, self.link, self.split, **options)


def load_pipeline(path, link: Link, split: Optional[str] = None, **options):
    """This rank's `PipelineModel` from its local copy of the folder (and the tokenizer);
    vision=True loads the tower on rank 0 (None: when rank 0's folder has it)."""
    from ..checkpoint.source import load

    options.setdefault("dspark", False)  # True: the drafter on the last rank
    options.setdefault("vision", False)  # True (or None: if the folder has it) on rank 0
    return load(path, placement=PipelinePlacement(link, split), **options)
