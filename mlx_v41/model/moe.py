"""Mixture of experts: sqrt-softplus router with selection bias, top-k routed FP4 experts with
clamped SwiGLU, and one shared FP8 expert (official inference/model.py L792–904). Image-span
positions choose their experts with `bias_vl` instead of `bias`.

Routed weights multiply the SwiGLU activation before `w2` (reference order, which also decides
what `w2`'s FP8 input rounding sees). On the Metal path the router's selection after its
matmul and each expert's SwiGLU + act_fp8 are one fused kernel each (kernels/router.py,
kernels/swiglu.py), and so is the sort of the (token, expert) pairs by expert for the sorted
gather (kernels/moe_order.py); the routed sum and the shared expert's add are one compiled kernel on
every path.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn

from ..numerics.mhc import along, chain_sum
from ..kernels.context import settle
from ..kernels.moe_order import moe_order
from ..kernels.router import _sqrt_softplus, router, router_ops  # noqa: F401 (re-exported)
from ..kernels.swiglu import swiglu, swiglu_act_fp8
from .layers import QuantLinear, allocate_quantized, batch_rows, round_act_fp8
from .paired import paired_matmul

SORT_THRESHOLD = 64  # below this many (token, expert) pairs, gathering unsorted is cheaper


class Router(nn.Module):
    def __init__(self, hidden_size: int, n_experts: int, top_k: int, route_scale: float):
        super().__init__()
        # Held in fp32 (the reference promotes it per call): no per-token cast of [E, D].
        self.weight = mx.zeros((n_experts, hidden_size), dtype=mx.float32)
        self.e_score_correction_bias = mx.zeros((n_experts,), dtype=mx.float32)
        self.bias_vl = mx.zeros((n_experts,), dtype=mx.float32)
        self.top_k, self.route_scale = top_k, route_scale

    def __call__(self, x: mx.array, image_mask: Optional[mx.array] = None):
        """-> (expert ids [B, S, k] int32, weights [B, S, k] fp32). Positions where
        `image_mask` [B, S] is True select with `bias_vl`; the weights never see a bias."""
        ids, weights = self.select(x, image_mask, ops_order=True)
        return ids.astype(mx.int32), weights

    def select(self, x: mx.array, image_mask: Optional[mx.array] = None,
               ops_order: bool = False):
        """As `__call__`, with the ids uint32 (argpartition's dtype, the one gather_qmm
        takes): the experts need no index cast. Through the router's dispatcher (its kernel
        orders the ids otherwise and holds the weights to a few ulps, kernels/router.py);
        `ops_order`: the ops' order, as the reference's captures have it."""
        return router(x, self.weight, self.e_score_correction_bias, self.bias_vl, image_mask,
                      self.top_k, self.route_scale, ops_order=ops_order)


class SwitchLinear(nn.Module):
    """Stacked per-expert packed weights `[E, N, K*bits/32]`, applied with `gather_qmm`."""

    def __init__(self, input_dims, output_dims, n_experts, mode="mxfp4", bits=4, group_size=32):
        super().__init__()
        allocate_quantized(self, (n_experts,), output_dims, input_dims, mode, bits, group_size)

    def __call__(self, x, ids, sorted_ids=False):
        return self.matmul(x, ids, sorted_ids).astype(mx.bfloat16)

    def matmul(self, x, ids, sorted_ids=False):
        """The fp32 products, before the bf16 rounding of the output (which the consumer
        applies inside its own fused kernel). fp32 input: see QuantLinear."""
        return mx.gather_qmm(
            x.astype(mx.float32), self.weight, self.scales, self.get("biases"),
            lhs_indices=batch_rows(x.shape[:-2]), rhs_indices=ids, transpose=True,
            group_size=self.group_size, bits=self.bits, mode=self.mode,
            sorted_indices=sorted_ids)


def clamped_swiglu(gate: mx.array, up: mx.array, limit: float) -> mx.array:
    """fp32 `silu(min(g, limit)) * clip(u, -limit, limit)` (compiled per limit)."""
    return _compiled_swiglu(limit)(gate, up)


@functools.cache
def _compiled_swiglu(limit: float):
    return mx.compile(functools.partial(swiglu, limit=limit))


def down_input(gate: mx.array, up: mx.array, weights: Optional[mx.array],
               limit: float) -> mx.array:
    """The down projection's fp32 input from the gate / up fp32 products: act_fp8 of the bf16
    (weighted) SwiGLU (kernels/swiglu.py)."""
    return swiglu_act_fp8(gate, up, weights, limit)


class SwitchMLP(nn.Module):
    def __init__(self, hidden, inter, n_experts, limit):
        super().__init__()
        self.gate_proj = SwitchLinear(hidden, inter, n_experts)
        self.up_proj = SwitchLinear(hidden, inter, n_experts)
        self.down_proj = SwitchLinear(inter, hidden, n_experts)
        self.limit = limit

    @property
    def n_experts(self) -> int:
        """Experts in this module's table (a tensor-parallel rank's share)."""
        return self.gate_proj.weight.shape[0]

    def __call__(self, x, ids, weights):
        """x [T, D] (FP8-rounded), ids/weights [T, k] -> per-expert outputs [T, k, D]: fp32
        products of `down_proj`, not yet rounded to its bf16 output (`MoE` rounds them)."""
        return expert_products(self.gate_proj, self.up_proj, self.down_proj, self.limit, x,
                               ids, weights)


def expert_products(gate: SwitchLinear, up: SwitchLinear, down: SwitchLinear, limit: float,
                    x: mx.array, ids: mx.array, weights: mx.array) -> mx.array:
    """`SwitchMLP`'s products over the tables `gate`, `up`, `down` (its own, or the streamed
    experts' slots with `ids` mapped to slots): x [T, D], ids/weights [T, k] -> [T, k, D]."""
    tokens, k = ids.shape
    ids = ids.astype(mx.uint32)  # gather_qmm's index dtype (a no-op for `Router.select`'s)
    if tokens * k < SORT_THRESHOLD:
        rows = x[:, None, None, :]                      # [T, 1, 1, D] against [T, k]
        act = down_input(gate.matmul(rows, ids), up.matmul(rows, ids),
                         weights[..., None, None], limit)
        return down.matmul(act, ids).squeeze(-2)
    rows, sorted_ids, sorted_weights, place = moe_order(ids.reshape(-1), weights.reshape(-1),
                                                         x, k)
    rows = rows[:, None, :]                             # [T*k, 1, D] grouped by expert
    act = down_input(gate.matmul(rows, sorted_ids, True), up.matmul(rows, sorted_ids, True),
                     sorted_weights[:, None, None], limit)
    out = down.matmul(act, sorted_ids, True)
    return out[place].reshape(tokens, k, -1)            # [T, k, D] fp32 products


class SharedExpert(nn.Module):
    paired = ("gate_proj", "up_proj")  # one matmul over both weights (paired.py)

    def __init__(self, hidden, inter, limit):
        super().__init__()
        self.gate_proj = QuantLinear(hidden, inter)
        self.up_proj = QuantLinear(hidden, inter)
        self.down_proj = QuantLinear(inter, hidden)
        self.limit = limit

    def __call__(self, x, prepared=None):
        """fp32 products of `down_proj`, before its bf16 rounding. `prepared`: x already
        act_fp8-rounded (the routed experts' input, shared)."""
        xq = self.gate_proj.prepare(x) if prepared is None else prepared
        gate, up = paired_matmul(self.gate_proj, self.up_proj, xq)  # one matmul, same bits
        act = down_input(gate, up, None, self.limit)  # and `down_proj`'s act_fp8
        return self.down_proj.matmul(act)


class MoE(nn.Module):
    def __init__(self, hidden, inter, n_experts, top_k, route_scale, limit):
        super().__init__()
        self.gate = Router(hidden, n_experts, top_k, route_scale)
        self.experts = nn.Module()
        self.experts.switch_mlp = SwitchMLP(hidden, inter, n_experts, limit)
        self.shared_experts = SharedExpert(hidden, inter, limit)

    def __call__(self, x: mx.array, image_mask: Optional[mx.array] = None,
                 record: Optional[Callable] = None, x32: Optional[mx.array] = None,
                 x_fp8: Optional[mx.array] = None) -> mx.array:
        """x [B, S, D] bf16; `image_mask` [B, S] (see `Router`); `record(name, value)` receives
        `gate.indices` and `gate.weights` (in the ops' order); `x32`: x in fp32 if the caller
        has it (the router reads fp32); `x_fp8`: the act_fp8 of x as fp32 [B*S, D] if the
        caller has it (the experts' input)."""
        batch, length, dim = x.shape
        source = x if x32 is None else x32
        ids, weights = self.gate.select(source, image_mask, ops_order=record is not None)
        settle(ids, weights)
        if record is not None:
            record("gate.indices", ids.astype(mx.int32))
            record("gate.weights", weights)
        if x_fp8 is None:
            flat = round_act_fp8(x.reshape(-1, dim), mx.float32)
        else:
            flat = x_fp8.reshape(-1, dim)
        k = ids.shape[-1]
        routed = self.experts.switch_mlp(flat, ids.reshape(-1, k), weights.reshape(-1, k))
        settle(routed)
        shared = self.shared_experts(x, flat)
        return _routed_and_shared(routed, shared).reshape(batch, length, dim)

    def routed_sum(self, flat: mx.array, ids: mx.array, weights: mx.array) -> mx.array:
        """[T, D] fp32 sum over the k chosen experts of their bf16 outputs; flat [T, D]
        FP8-rounded, ids / weights [B, S, k]."""
        k = ids.shape[-1]
        routed = self.experts.switch_mlp(flat, ids.reshape(-1, k), weights.reshape(-1, k))
        return mx.sum(_bf16_rounded(routed), axis=1)

    @staticmethod
    def combine(routed: mx.array, shared: mx.array) -> mx.array:
        """bf16 output from the routed sum and the shared expert's fp32 products."""
        return _add_shared(routed, shared)


@mx.compile
def _bf16_rounded(x: mx.array) -> mx.array:
    """fp32 of the bf16 rounding of x (a projection's output as its consumer reads it)."""
    return x.astype(mx.bfloat16).astype(mx.float32)


@mx.compile
def _add_shared(routed: mx.array, shared: mx.array) -> mx.array:
    return (routed + _bf16_rounded(shared)).astype(mx.bfloat16)


@mx.compile
def _routed_and_shared(routed: mx.array, shared: mx.array) -> mx.array:
    """`combine(sum of bf16(routed) over the k experts, shared)` in one fused kernel: the sum
    as a chain of adds from 0 over the experts in order, the bits of MLX's CPU reduction over
    that axis (a lone expert: no add, as the reduction copies it). Each expert's slice is
    rounded on its own, so the rounding fuses into the adds."""
    parts = [_bf16_rounded(part.squeeze(1)) for part in along(routed, 1)]
    return _add_shared(chain_sum(parts, 0.0 if len(parts) > 1 else None), shared)
