"""Mixture of experts: sqrt-softplus router with selection bias, top-k routed FP4 experts with
clamped SwiGLU, and one shared FP8 expert (official inference/model.py L792–904). Image-span
positions choose their experts with `bias_vl` instead of `bias`.

Routed weights multiply the SwiGLU activation before `w2` (reference order, which also decides
what `w2`'s FP8 input rounding sees).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn

from .layers import QuantLinear, allocate_quantized, batch_rows, round_act_fp8

SOFTPLUS_THRESHOLD = 20.0  # torch's softplus is linear above this
SORT_THRESHOLD = 64  # below this many (token, expert) pairs, gathering unsorted is cheaper
ROUTER_EPS = 1e-20


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
        ids, weights = self.select(x, image_mask)
        return ids.astype(mx.int32), weights

    def select(self, x: mx.array, image_mask: Optional[mx.array] = None):
        """As `__call__`, with the ids uint32 (argpartition's dtype, the one gather_qmm
        takes): the experts need no index cast."""
        logits = x.astype(mx.float32) @ self.weight.T
        bias = self.e_score_correction_bias
        if image_mask is not None:
            bias = mx.where(image_mask[..., None], self.bias_vl, bias)
        scores, negated = _scores_and_negated_biased(logits, bias)
        ids = mx.argpartition(negated, self.top_k - 1, axis=-1)[..., :self.top_k]
        weights = mx.take_along_axis(scores, ids, axis=-1)
        total = mx.sum(weights, axis=-1, keepdims=True)
        return ids, _normalised(weights, total, self.route_scale)


@mx.compile
def _sqrt_softplus(logits: mx.array) -> mx.array:
    return mx.sqrt(mx.where(logits > SOFTPLUS_THRESHOLD, logits, mx.logaddexp(logits, 0.0)))


@mx.compile
def _scores_and_negated_biased(logits: mx.array, bias: mx.array):
    """sqrt(softplus(logits)) and -(it + bias), argpartition's key, from one fused kernel
    (apart: the scores' kernel, an add and a negation)."""
    scores = _sqrt_softplus(logits)
    return scores, -(scores + bias)


@functools.partial(mx.compile, shapeless=True)
def _normalised(weights: mx.array, total: mx.array, scale) -> mx.array:
    return weights / (total + ROUTER_EPS) * scale


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
            lhs_indices=batch_rows(x.shape[:-2]), rhs_indices=ids, transpose=True, group_size=self.group_size, bits=self.bits, mode=self.mode,
            sorted_indices=sorted_ids)


def clamped_swiglu(gate: mx.array, up: mx.array, limit: float) -> mx.array:
    """fp32 `silu(min(g, limit)) * clip(u, -limit, limit)` (compiled per limit)."""
    return _compiled_swiglu(limit)(gate, up)


def _swiglu(gate: mx.array, up: mx.array, limit: float) -> mx.array:
    gate = mx.minimum(gate.astype(mx.float32), limit)
    up = mx.clip(up.astype(mx.float32), -limit, limit)
    return gate * mx.sigmoid(gate) * up


@functools.cache
def _compiled_swiglu(limit: float):
    return mx.compile(functools.partial(_swiglu, limit=limit))


def _swiglu_of_products(gate: mx.array, up: mx.array, weights, limit: float) -> mx.array:
    """bf16 of the (weighted) SwiGLU of fp32 projection products, each rounded to bf16 first
    as the projections' outputs are: one fused kernel from the two matmuls to the next."""
    act = _swiglu(gate.astype(mx.bfloat16), up.astype(mx.bfloat16), limit)
    return (act if weights is None else act * weights).astype(mx.bfloat16)


@functools.cache
def _compiled_swiglu_of_products(limit: float, weighted: bool):
    if weighted:
        return mx.compile(functools.partial(_swiglu_of_products, limit=limit))
    return mx.compile(lambda gate, up: _swiglu_of_products(gate, up, None, limit))


class SwitchMLP(nn.Module):
    def __init__(self, hidden, inter, n_experts, limit):
        super().__init__()
        self.gate_proj = SwitchLinear(hidden, inter, n_experts)
        self.up_proj = SwitchLinear(hidden, inter, n_experts)
        self.down_proj = SwitchLinear(inter, hidden, n_experts)
        self.limit = limit

    def __call__(self, x, ids, weights, kernels=None):
        """x [T, D] (FP8-rounded), ids/weights [T, k] -> per-expert outputs [T, k, D]: fp32
        products of `down_proj`, not yet rounded to its bf16 output (`MoE` rounds them).
        `kernels`: the model's (the act_fp8 kernel where they apply)."""
        tokens, k = ids.shape
        ids = ids.astype(mx.uint32)  # gather_qmm's index dtype (a no-op for `Router.select`'s)
        swiglu = _compiled_swiglu_of_products(self.limit, True)
        if tokens * k < SORT_THRESHOLD:
            rows = x[:, None, None, :]                      # [T, 1, 1, D] against [T, k]
            act = swiglu(self.gate_proj.matmul(rows, ids), self.up_proj.matmul(rows, ids),
                         weights[..., None, None])
            act = round_act_fp8(act, mx.float32, kernels=kernels)
            return self.down_proj.matmul(act, ids).squeeze(-2)
        flat_ids = ids.reshape(-1)
        order = mx.argsort(flat_ids)
        inverse = mx.argsort(order)
        rows = mx.expand_dims(x, -2)[order // k]          # [T*k, 1, D] grouped by expert
        sorted_ids = flat_ids[order]
        act = swiglu(self.gate_proj.matmul(rows, sorted_ids, True),
                     self.up_proj.matmul(rows, sorted_ids, True),
                     weights.reshape(-1)[order][:, None, None])
        act = round_act_fp8(act, mx.float32, kernels=kernels)
        out = self.down_proj.matmul(act, sorted_ids, True)
        return out[inverse].reshape(tokens, k, -1)          # [T, k, D] fp32 products


class SharedExpert(nn.Module):
    def __init__(self, hidden, inter, limit):
        super().__init__()
        self.gate_proj = QuantLinear(hidden, inter)
        self.up_proj = QuantLinear(hidden, inter)
        self.down_proj = QuantLinear(inter, hidden)
        self.limit = limit

    def __call__(self, x, prepared=None, kernels=None):
        """fp32 products of `down_proj`, before its bf16 rounding. `prepared`: x already
        act_fp8-rounded (the routed experts' input, shared)."""
        xq = self.gate_proj.prepare(x, kernels=kernels) if prepared is None else prepared
        swiglu = _compiled_swiglu_of_products(self.limit, False)
        act = swiglu(self.gate_proj.matmul(xq), self.up_proj.matmul(xq))
        return self.down_proj.matmul(self.down_proj.prepare(act, kernels=kernels))


class MoE(nn.Module):
    def __init__(self, hidden, inter, n_experts, top_k, route_scale, limit):
        super().__init__()
        self.gate = Router(hidden, n_experts, top_k, route_scale)
        self.experts = nn.Module()
        self.experts.switch_mlp = SwitchMLP(hidden, inter, n_experts, limit)
        self.shared_experts = SharedExpert(hidden, inter, limit)

    def __call__(self, x: mx.array, image_mask: Optional[mx.array] = None,
                 record: Optional[Callable] = None, x32: Optional[mx.array] = None,
                 kernels=None) -> mx.array:
        """x [B, S, D] bf16; `image_mask` [B, S] (see `Router`); `record(name, value)` receives
        `gate.indices` and `gate.weights`; `x32`: x in fp32 if the caller has it (the router
        reads fp32); `kernels`: the model's (the act_fp8 kernel where they apply)."""
        batch, length, dim = x.shape
        ids, weights = self.gate.select(x if x32 is None else x32, image_mask)
        if record is not None:
            record("gate.indices", ids.astype(mx.int32))
            record("gate.weights", weights)
        flat = round_act_fp8(x.reshape(-1, dim), mx.float32, kernels=kernels)
        total = self.routed_sum(flat, ids, weights, kernels)
        shared = self.shared_experts(x, flat, kernels)
        return self.combine(total, shared).reshape(batch, length, dim)

    def routed_sum(self, flat: mx.array, ids: mx.array, weights: mx.array,
                   kernels=None) -> mx.array:
        """[T, D] fp32 sum over the k chosen experts of their bf16 outputs; flat [T, D]
        FP8-rounded, ids / weights [B, S, k]."""
        k = ids.shape[-1]
        routed = self.experts.switch_mlp(flat, ids.reshape(-1, k), weights.reshape(-1, k),
                                         kernels)
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
