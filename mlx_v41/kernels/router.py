"""MoE router (official inference/model.py L792-830): fp32 logits x . W_e, scores
sqrt(softplus(logits)), the top-k experts by score + selection bias (`bias_vl` at image
positions), weights = their scores / (their sum + 1e-20) * route_scale.

The ops are the model's own (six launches: the fp32 matmul, the scores' fused kernel,
argpartition, the gather, the sum, the normalisation). The Metal path keeps the matmul (MLX's,
on the whole GPU: one threadgroup reading all of W [E, D] would run on one GPU core) and does
the rest of a token row in one launch of metal/router.metal, one simdgroup per row, any
number of rows: two launches. From the same logits the kernel is not the ops' bits: its
scores follow MLX's Metal logaddexp / log1p formula (on a Mac the ops' own; on the simulator,
against MLX's CPU polynomial exp and libm log1p, about a third of the scores an ulp or more
apart), and it sums the k picked scores in pick order, the ops in argpartition's. Two
sums of k terms differ by at most 2(k - 1) ulps of the total, so the weights hold within
CHECK_TOLERANCE of the largest (2^-20.2 for k = 8, plus the scores' ulps; measured 2^-21.5);
where two keys are that close the pick may differ; ties go to the lower id. Its ids come in
order of decreasing key, the ops' in argpartition's order: compare them as sets (`by_id`).
"""

from __future__ import annotations

import functools
from typing import Optional

import mlx.core as mx

from .check import assert_close, assert_equal
from .spec import KernelSpec

SOFTPLUS_THRESHOLD = 20.0  # torch's softplus is linear above this
ROUTER_EPS = 1e-20
MAX_EXPERTS = 1024  # the kernel marks each lane's picked experts in a 32-bit mask
ROWS_PER_GROUP = 8  # token rows (simdgroups) per threadgroup
CHECK_TOLERANCE = 2.0 ** -19  # of the largest weight: see the module docstring


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


def router_logits(x: mx.array, weight: mx.array) -> mx.array:
    """[..., E] fp32 logits of x [..., D] against the gate weight [E, D]: the one matmul both
    paths run (MLX's), so the kernel and the ops select from the same bits."""
    return x.astype(mx.float32) @ weight.T


def select_ops(logits: mx.array, bias: mx.array, bias_vl: mx.array,
               image_mask: Optional[mx.array], top_k: int, route_scale: float):
    """The ops after the matmul, from fp32 logits [..., E]; the rest as in `router`."""
    if image_mask is not None:
        bias = mx.where(image_mask[..., None], bias_vl, bias)
    scores, negated = _scores_and_negated_biased(logits, bias)
    ids = mx.argpartition(negated, top_k - 1, axis=-1)[..., :top_k]
    weights = mx.take_along_axis(scores, ids, axis=-1)
    total = mx.sum(weights, axis=-1, keepdims=True)
    return ids, _normalised(weights, total, route_scale)


def router_ops(x: mx.array, weight: mx.array, bias: mx.array, bias_vl: mx.array,
               image_mask: Optional[mx.array], top_k: int, route_scale: float):
    """Reference (pure MLX); arguments as in `router`. The ids are argpartition's (uint32, in
    its order)."""
    return select_ops(router_logits(x, weight), bias, bias_vl, image_mask, top_k, route_scale)


def by_id(ids: mx.array, weights: mx.array):
    """(ids, weights) with each row's experts in increasing id: the kernel's and the ops'
    picks in one order, to compare."""
    order = mx.argsort(ids, axis=-1)
    return mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(weights, order, axis=-1)


def _select(kernel, logits, bias, bias_vl, image_mask, top_k: int, route_scale: float):
    """The kernel's part of the Metal path (the built run's `select`): from fp32 logits, as
    `select_ops`."""
    experts = logits.shape[-1] if logits.ndim else 0
    if not 1 <= top_k <= experts or experts > MAX_EXPERTS:
        raise ValueError(f"router: top_k {top_k} of {experts} experts (at most {MAX_EXPERTS})")
    if logits.dtype != mx.float32:
        raise ValueError(f"router: logits must be float32, got {logits.dtype}")
    if bias.shape != (experts,) or bias_vl.shape != (experts,):
        raise ValueError(f"router: bias {bias.shape}, bias_vl {bias_vl.shape} do not fit "
                         f"{experts} experts")
    lead = logits.shape[:-1]
    rows = logits.size // experts
    if image_mask is not None and image_mask.size != rows:
        raise ValueError(f"router: image_mask {image_mask.shape} does not fit the rows {lead}")
    if rows == 0:
        return (mx.zeros((*lead, top_k), mx.uint32), mx.zeros((*lead, top_k), mx.float32))
    # Without a mask, `mask` is bound to the bias (never read: MASKED is false).
    mask = bias if image_mask is None else image_mask.reshape(rows)
    ids, weights = kernel(
        inputs=[logits.reshape(rows, experts), bias.astype(mx.float32),
                bias_vl.astype(mx.float32), mask, float(route_scale)],
        template=[("E", experts), ("K", top_k), ("MASKED", image_mask is not None)],
        grid=(32, rows, 1), threadgroup=(32, min(rows, ROWS_PER_GROUP), 1),
        output_shapes=[(rows, top_k), (rows, top_k)], output_dtypes=[mx.uint32, mx.float32])
    return ids.reshape(*lead, top_k), weights.reshape(*lead, top_k)


def _launch(kernel, x, weight, bias, bias_vl, image_mask, top_k: int, route_scale: float):
    if weight.ndim != 2 or x.ndim == 0 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"router: x {x.shape} does not fit weight {weight.shape}")
    return _select(kernel, router_logits(x, weight), bias, bias_vl, image_mask, top_k,
                   route_scale)


def _probe(run, ops) -> None:
    """Three rows of 64 channels over 40 experts, top 6, one row at an image position: the same
    experts, their weights within CHECK_TOLERANCE."""
    wave = lambda n, f: mx.sin(mx.arange(n, dtype=mx.float32) * f)  # noqa: E731
    x = (wave(3 * 64, 0.61) * 2).reshape(3, 64)
    weight = (wave(40 * 64, 0.173) * 0.5).reshape(40, 64)
    args = (x, weight, wave(40, 1.3) * 0.2, wave(40, 0.9) * 0.2, mx.array([False, True, False]),
            6, 2.5)
    got, want = by_id(*run(*args)), by_id(*ops(*args))
    assert_equal("router ids", got[0].astype(mx.uint32), want[0].astype(mx.uint32))
    assert_close("router weights", got[1], want[1], CHECK_TOLERANCE)


# The Metal path as `run(x, weight, bias, bias_vl, image_mask, top_k, route_scale)`:
# `router_logits`, then metal/router.metal as `run.select(logits, bias, bias_vl, image_mask,
# top_k, route_scale)`.
ROUTER = KernelSpec("v41_router", "router", ("logits", "bias", "bias_vl", "mask", "route_scale"),
                    ("ids", "weights"), "router.metal", _launch, _probe, router_ops,
                    exact=False, methods=(("select", _select),))


def router(x: mx.array, weight: mx.array, bias: mx.array, bias_vl: mx.array,
           image_mask: Optional[mx.array], top_k: int, route_scale: float,
           use_kernel: Optional[bool] = None, run=None, ops_order: bool = False):
    """The routed experts of each token and their weights.

    Args:
        x: [..., D] token rows (read in fp32).
        weight: [E, D] fp32 gate weight; bias, bias_vl: [E] fp32 selection biases.
        image_mask: None, or [...] bool: the rows that select with `bias_vl`.
        top_k: experts per token; route_scale: the weights' scale.
        use_kernel: use the Metal path (MLX's matmul, then the kernel) when it applies.
        run: an already built kernel (`ROUTER.build(factory)`) to use unconditionally, e.g. the
            Metal simulator's in tests.
        ops_order: the ids in the ops' order (the reference goldens' captures): the ops.
    Returns:
        (ids [..., k] uint32, weights [..., k] fp32). The kernel's ids are ordered by key, the
        ops' as argpartition leaves them; the weights follow their ids.
    """
    run = ROUTER.choose(use_kernel, run)
    if ops_order or run is None:
        return router_ops(x, weight, bias, bias_vl, image_mask, top_k, route_scale)
    return run(x, weight, bias, bias_vl, image_mask, top_k, route_scale)
