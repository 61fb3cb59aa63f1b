"""Tensor parallel inference: every rank runs every layer on its share of the attention heads
(query rows of `q_b_proj`, sinks, `o_a_proj` output groups, the matching input columns of
`o_b_proj`), of the routed experts (whole experts) and of the shared expert's inner width.
`o_b_proj` and the experts end in partial fp32 sums, added over the ranks by `all_sum` (one
for attention, one for the routed + shared experts of each layer, [2, T, D]) before their bf16
rounding. The rest is replicated and computed alike on every rank: embedding, norms, mHC,
low-rank query and KV projections (one KV head), compressor, indexer, router, Engram, head.

Routed experts are split by expert, not by inner width: a layer then reduces one [T, D] sum
of the experts' bf16 outputs; an inner-width split would have to reduce every expert's fp32
products [T, k, D] before their bf16 rounding (k = 6 times the bytes) to keep the numerics.
A rank evaluates the pairs routed to another rank's experts at weight 0 (exact zeros; no host
round trip to compact them). The DSpark drafter's stages split the same way (their attention
and MoE use the same projections), so every rank drafts the same tokens from the same logits.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from ..checkpoint.placement import Placement
from ..checkpoint.slicing import Shard
from ..model.layers import QuantLinear, allocate_quantized, round_act_fp8
from ..model.model import Model
from ..model.moe import MoE
from ..numerics.quant import WEIGHT_BLOCK
from .group import RankGroup
from .link import Link, is_backend_error


class ShardError(ValueError):
    """A model that cannot be split over the launched ranks (the message names the field)."""


def check_shardable(cfg, size: int, drafter: bool = False) -> None:
    """Every split axis must divide evenly (the drafter's experts too, with `drafter`), and
    the shared expert's share must keep whole 32-wide FP8 scale blocks."""
    fields = ("num_attention_heads", "o_groups", "n_routed_experts")
    for field in fields + (("dspark_n_routed_experts",) if drafter else ()):
        value = getattr(cfg, field)
        if value % size:
            raise ShardError(f"--tensor-parallel: {field} = {value} does not split over {size} "
                             f"ranks (it must be a multiple of the number of ranks)")
    inner = cfg.moe_intermediate_size
    if inner % (WEIGHT_BLOCK * size):
        raise ShardError(f"--tensor-parallel: moe_intermediate_size = {inner} does not split "
                         f"over {size} ranks in whole {WEIGHT_BLOCK}-wide FP8 blocks")


class ShardPlan:
    """Loader target (module path, or a plain parameter's name) -> this rank's `Shard`."""

    def __init__(self):
        self.shards = {}

    def __call__(self, target: str) -> Optional[Shard]:
        return self.shards.get(target)

    def add(self, target: str, axis: str, rank: int, share: int, total: int) -> None:
        self.shards[target] = Shard(axis, rank * share, (rank + 1) * share, total)


def _resize(module: nn.Module, lead: tuple, output_dims: int, input_dims: int) -> None:
    """Re-lay a packed linear at its share's shape (zeros until loaded)."""
    allocate_quantized(module, lead, output_dims, input_dims, module.mode, module.bits,
                       module.group_size)


class ReducedLinear(QuantLinear):
    """A linear over this rank's input columns: its fp32 products are summed over the ranks
    before the bf16 rounding of the output (`o_b_proj`; `apply` rounds `matmul`'s sum)."""

    def matmul(self, x: mx.array) -> mx.array:
        return self.link.reduce(super().matmul(x))


class ShardedMoE(MoE):
    """Router on every rank; this rank's experts (`first_expert` on) and shared-expert share;
    one reduction of [routed sum, shared products]."""

    def __call__(self, x: mx.array, image_mask: Optional[mx.array] = None, record=None,
                 x32: Optional[mx.array] = None, x_fp8: Optional[mx.array] = None):
        batch, length, dim = x.shape
        # the router's ops on every rank (their ids' order, as a single process records them)
        ids, weights = self.gate.select(x if x32 is None else x32, image_mask, ops_order=True)
        if record is not None:
            record("gate.indices", ids.astype(mx.int32))
            record("gate.weights", weights)
        count = self.experts.switch_mlp.n_experts
        mine = (ids >= self.first_expert) & (ids < self.first_expert + count)
        local = mx.where(mine, ids - self.first_expert, 0)
        weights = mx.where(mine, weights, 0.0)
        flat = round_act_fp8(x.reshape(-1, dim), mx.float32) \
            if x_fp8 is None else x_fp8.reshape(-1, dim)
        partial = mx.stack([self.routed_sum(flat, local, weights),
                            self.shared_experts(x, flat)])
        routed, shared = self.link.reduce(partial)
        return self.combine(routed, shared).reshape(batch, length, dim)


class TensorParallelModel(Model):
    """A `Model` holding one rank's share of every layer: build with `load_tensor_parallel`;
    calls and caches as `Model`'s (the caches are whole on every rank: one KV head), run by
    every rank together."""

    def __init__(self, args, link: Link, **options):
        check_shardable(args.text_config, link.size, bool(options.get("dspark")))
        super().__init__(args, **options)
        self.link, self.rank = link, link.rank
        self.ranges = f"tensor parallel x{link.size}"  # what the startup handshake compares
        self.group = RankGroup(link, self.ranges, is_pipeline=False)  # what generation is given
        self.plan = ShardPlan()  # what this rank loads of each split tensor
        blocks = [(f"model.layers.{i}", layer) for i, layer in enumerate(self.model.layers)]
        if "dspark" in self:  # the drafter's stages are the same attention and MoE classes
            blocks += [(f"dspark.stages.{k}", stage) for k, stage in enumerate(self.dspark.stages)]
        for path, block in blocks:
            self._shard_attention(f"{path}.self_attn", block.self_attn)
            self._shard_moe(f"{path}.mlp", block.mlp)

    def forward(self, *args, **kwargs):
        """`Model.forward`; a collective that failed inside it (a rank lost) raises one
        DistributedError line (one evaluated later, by the caller, raises MLX's error)."""
        self.link.watchdog.beat()  # the previous call's reductions were evaluated
        if kwargs.get("step_size"):  # a prefill: each evaluated chunk is progress too
            kwargs["progress"] = self.link.watchdog.beating(kwargs.get("progress"))
        try:
            return super().forward(*args, **kwargs)
        except RuntimeError as e:
            if not is_backend_error(e):
                raise
            raise self.link.lost(e, "computing a layer") from None

    def _shard_attention(self, path: str, attn) -> None:
        cfg, rank, size, plan = self.cfg, self.rank, self.link.size, self.plan
        heads, groups, d = cfg.num_attention_heads // size, cfg.o_groups // size, cfg.head_dim
        lora = cfg.o_lora_rank
        _resize(attn.q_b_proj, (), heads * d, cfg.q_lora_rank)
        plan.add(f"{path}.q_b_proj", "out", rank, heads * d, cfg.num_attention_heads * d)
        attn.sinks = mx.zeros((heads,), mx.float32)
        plan.add(f"{path}.sinks", "lead", rank, heads, cfg.num_attention_heads)
        _resize(attn.o_a_proj, (groups,), lora, heads * d // groups)
        plan.add(f"{path}.o_a_proj", "lead", rank, groups, cfg.o_groups)
        _resize(attn.o_b_proj, (), cfg.hidden_size, groups * lora)
        plan.add(f"{path}.o_b_proj", "in", rank, groups * lora, cfg.o_groups * lora)
        attn.o_b_proj.__class__ = ReducedLinear
        attn.o_b_proj.link = self.link
        attn.heads = heads

    def _shard_moe(self, path: str, moe) -> None:
        cfg, rank, size, plan = self.cfg, self.rank, self.link.size, self.plan
        dim, inner = cfg.hidden_size, cfg.moe_intermediate_size
        experts = moe.experts.switch_mlp.gate_proj.weight.shape[0]
        share = experts // size
        switch = moe.experts.switch_mlp
        for name, out, in_ in (("gate_proj", inner, dim), ("up_proj", inner, dim),
                               ("down_proj", dim, inner)):
            _resize(getattr(switch, name), (share,), out, in_)
            plan.add(f"{path}.experts.switch_mlp.{name}", "lead", rank, share, experts)
        shared, part = moe.shared_experts, inner // size
        for name in ("gate_proj", "up_proj"):
            _resize(getattr(shared, name), (), part, dim)
            plan.add(f"{path}.shared_experts.{name}", "out", rank, part, inner)
        _resize(shared.down_proj, (), dim, part)
        plan.add(f"{path}.shared_experts.down_proj", "in", rank, part, inner)
        moe.__class__ = ShardedMoE
        moe.first_expert, moe.link = rank * share, self.link


class TensorParallelPlacement(Placement):
    """A tensor-parallel rank's placement: its `TensorParallelModel`, which reads its share of
    each split tensor (the model's `ShardPlan`) and the rest whole."""

    def __init__(self, link: Link):
        self.link, self.plan = link, ShardPlan()

    def build(self, args, **options):
        model = TensorParallelModel(args, self.link, **options)
        self.plan = model.plan
        return model

    def shard(self, target: str) -> Optional[Shard]:
        return self.plan(target)


def load_tensor_parallel(path, link: Link, **options):
    """This rank's `TensorParallelModel` from its local copy of the folder (and the
    tokenizer): only its share of the split tensors is read."""
    from ..checkpoint.source import load

    options.setdefault("dspark", False)
    # The vision tower (replicated weights, no split) loads on rank 0 only, which reads the
    # images and shares each forward's span rows (`prompt.SharedImagePrompt`).
    options["vision"] = options.get("vision", False) if link.rank == 0 else False
    return load(path, placement=TensorParallelPlacement(link), **options)
