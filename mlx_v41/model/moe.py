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

from .layers import QuantLinear, allocate_quantized
from .quant import act_fp8_qdq

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
        logits = x.astype(mx.float32) @ self.weight.T
        soft = mx.where(logits > SOFTPLUS_THRESHOLD, logits, mx.logaddexp(logits, 0.0))
        scores = mx.sqrt(soft)
        bias = self.e_score_correction_bias
        if image_mask is not None:
            bias = mx.where(image_mask[..., None], self.bias_vl, bias)
        biased = scores + bias
        ids = mx.argpartition(-biased, self.top_k - 1, axis=-1)[..., :self.top_k]
        weights = mx.take_along_axis(scores, ids, axis=-1)
        weights = weights / (mx.sum(weights, axis=-1, keepdims=True) + ROUTER_EPS)
        return ids.astype(mx.int32), weights * self.route_scale


class SwitchLinear(nn.Module):
    """Stacked per-expert packed weights `[E, N, K*bits/32]`, applied with `gather_qmm`."""

    def __init__(self, input_dims, output_dims, n_experts, mode="mxfp4", bits=4, group_size=32):
        super().__init__()
        allocate_quantized(self, (n_experts,), output_dims, input_dims, mode, bits, group_size)

    def __call__(self, x, ids, sorted_ids=False):
        out = mx.gather_qmm(
            x.astype(mx.float32), self.weight, self.scales, self.get("biases"), rhs_indices=ids, transpose=True,
            group_size=self.group_size, bits=self.bits, mode=self.mode,
            sorted_indices=sorted_ids)
        return out.astype(mx.bfloat16)  # fp32 input: see QuantLinear


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


class SwitchMLP(nn.Module):
    def __init__(self, hidden, inter, n_experts, limit):
        super().__init__()
        self.gate_proj = SwitchLinear(hidden, inter, n_experts)
        self.up_proj = SwitchLinear(hidden, inter, n_experts)
        self.down_proj = SwitchLinear(inter, hidden, n_experts)
        self.limit = limit

    def __call__(self, x, ids, weights):
        """x [T, D] (FP8-rounded), ids/weights [T, k] -> per-expert outputs [T, k, D] bf16."""
        tokens, k = ids.shape
        if tokens * k < SORT_THRESHOLD:
            rows = x[:, None, None, :]                      # [T, 1, 1, D] against [T, k]
            act = clamped_swiglu(self.gate_proj(rows, ids), self.up_proj(rows, ids), self.limit)
            act = act_fp8_qdq((act * weights[..., None, None]).astype(mx.bfloat16), mx.float32)
            return self.down_proj(act, ids).squeeze(-2)
        flat_ids = ids.reshape(-1)
        order = mx.argsort(flat_ids)
        inverse = mx.argsort(order)
        rows = mx.expand_dims(x, -2)[order // k]          # [T*k, 1, D] grouped by expert
        sorted_ids = flat_ids[order]
        act = clamped_swiglu(self.gate_proj(rows, sorted_ids, True),
                             self.up_proj(rows, sorted_ids, True), self.limit)
        act = act * weights.reshape(-1)[order][:, None, None]
        act = act_fp8_qdq(act.astype(mx.bfloat16), mx.float32)
        out = self.down_proj(act, sorted_ids, True)       # [T*k, 1, D]
        return out[inverse].reshape(tokens, k, -1)


class SharedExpert(nn.Module):
    def __init__(self, hidden, inter, limit):
        super().__init__()
        self.gate_proj = QuantLinear(hidden, inter)
        self.up_proj = QuantLinear(hidden, inter)
        self.down_proj = QuantLinear(inter, hidden)
        self.limit = limit

    def __call__(self, x, prepared=None):
        """`prepared`: x already act_fp8-rounded (the routed experts' input, shared)."""
        xq = self.gate_proj.prepare(x) if prepared is None else prepared
        act = clamped_swiglu(self.gate_proj.apply(xq), self.up_proj.apply(xq), self.limit)
        return self.down_proj(act.astype(mx.bfloat16))


class MoE(nn.Module):
    def __init__(self, hidden, inter, n_experts, top_k, route_scale, limit):
        super().__init__()
        self.gate = Router(hidden, n_experts, top_k, route_scale)
        self.experts = nn.Module()
        self.experts.switch_mlp = SwitchMLP(hidden, inter, n_experts, limit)
        self.shared_experts = SharedExpert(hidden, inter, limit)

    def __call__(self, x: mx.array, image_mask: Optional[mx.array] = None,
                 record: Optional[Callable] = None) -> mx.array:
        """x [B, S, D]; `image_mask` [B, S] (see `Router`); `record(name, value)` receives
        `gate.indices` and `gate.weights`."""
        batch, length, dim = x.shape
        ids, weights = self.gate(x, image_mask)
        if record is not None:
            record("gate.indices", ids)
            record("gate.weights", weights)
        flat = act_fp8_qdq(x.reshape(-1, dim), mx.float32)
        routed = self.experts.switch_mlp(flat, ids.reshape(batch * length, -1),
                                         weights.reshape(batch * length, -1))
        total = mx.sum(routed.astype(mx.float32), axis=1)
        total = total + self.shared_experts(x, flat).astype(mx.float32)
        return total.astype(mx.bfloat16).reshape(batch, length, dim)
