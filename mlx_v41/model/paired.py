"""Paired projections: two quantized linears that read the same input (attention `kv_proj` +
`q_a_proj`, the shared expert's `gate_proj` + `up_proj`) run as ONE quantized matmul over their
weights concatenated along the output axis, one launch less each. Each output element is the
same dot product over the same packed row, so the products have the two matmuls' bits (every
layout the converter writes, on MLX's CPU backend: tests/test_paired_linears.py; on Metal where
MLX picks the same kernel for the sum as for each width, `_same_metal_kernel`).

The pairs are made once, when a model's weights are loaded (`pair_projections`: the loader,
and `Model.update` / `load_weights` after any replacement), never during a forward. A module
names its pair in a `paired` class attribute; the linears' parameters become views of the
concatenation, so the bytes are not doubled and `parameters()` keeps its names and shapes.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from .layers import QuantLinear, input_dims

PACKED = ("weight", "scales", "biases")  # a packed linear's arrays, all split by output row
METAL_TILE = 32  # output widths in whole tiles: MLX's aligned qmm_t and fast qmv on Metal
# Metal's qmv -> qmm row limit changes at these input / output widths (mlx metal/quantized.cpp)
METAL_QMV_CLASSES = (2048, 4096)


class Pair:
    """Two linears' packed arrays concatenated along the output axis; the linears hold views
    of them instead of their own arrays. Evaluated when made: a forward may run on another
    thread (the server's worker), and MLX refuses to evaluate an array made on another
    thread's stream."""

    def __init__(self, first: QuantLinear, second: QuantLinear):
        names = [n for n in PACKED if n in first]
        self.split = first.weight.shape[0]
        arrays = {n: mx.concatenate([first[n], second[n]]) for n in names}
        self.packed = (arrays["weight"], arrays["scales"], arrays.get("biases"))
        views = ({n: a[:self.split] for n, a in arrays.items()},
                 {n: a[self.split:] for n, a in arrays.items()})
        mx.eval(arrays, views)
        for module, held in zip((first, second), views):
            module.update(held)
        self.layout = dict(group_size=first.group_size, bits=first.bits, mode=first.mode)

    def matmul(self, x: mx.array):
        """(first's products, second's products) of x [..., S, K] in one matmul."""
        out = mx.quantized_matmul(x, *self.packed, transpose=True, **self.layout)
        return out[..., :self.split], out[..., self.split:]


def pair_projections(model: nn.Module) -> int:
    """Pair the linears that every module with a `paired` = (first, second) attribute names,
    where they can pair (`can_pair`); drop stale pairs elsewhere. Returns how many pairs."""
    count = 0
    for _, module in model.named_modules():
        names = getattr(type(module), "paired", None)
        if names is None:
            continue
        first, second = (module[n] for n in names)
        first.pair = Pair(first, second) if can_pair(first, second) else None
        count += first.pair is not None
    return count


def paired_matmul(first: QuantLinear, second: QuantLinear, x: mx.array,
                  second_rows: Optional[int] = None):
    """(first.matmul(x), second.matmul(the last `second_rows` rows of x)) for x [..., S, K]
    (`second_rows`: all S by default): one matmul where the two were paired at load and both
    read every row (the same bits), else two."""
    if x.ndim < 2:
        raise ValueError(f"paired_matmul takes rows [..., S, K], got shape {x.shape}")
    rows = x.shape[-2]
    second_rows = rows if second_rows is None else second_rows
    # Apart where the second reads fewer rows: over other rows Metal may pick another kernel.
    if first.pair is None or second_rows != rows:
        return first.matmul(x), second.matmul(x[..., rows - second_rows:, :])
    return first.pair.matmul(x)


def can_pair(first: QuantLinear, second: QuantLinear) -> bool:
    """Whether one matmul over both weights gives each one's bits: plain `QuantLinear.matmul`
    (a subclass may reduce or reshape its products), one layout (mode, bits, group size, input
    rounding, arrays and dtypes, input width), 2-D weights, and output widths for which
    MLX's Metal backend picks the same kernel as for their sum (`_same_metal_kernel`)."""
    modules = (first, second)
    if any(type(m).matmul is not QuantLinear.matmul for m in modules):
        return False
    layout = [(m.mode, m.bits, m.group_size, m.quantize_input,
               tuple((n, m[n].dtype, m[n].ndim, m[n].shape[-1]) for n in PACKED if n in m))
              for m in modules]
    if layout[0] != layout[1] or first.weight.ndim != 2:
        return False
    widths = (first.weight.shape[0], second.weight.shape[0])
    return _same_metal_kernel(input_dims(first), widths)


def _same_metal_kernel(input_width: int, widths: tuple) -> bool:
    """MLX's Metal quantized matmul chooses its kernel from the rows, the input width and the
    output width: whole tiles (`METAL_TILE`) and one qmv row-limit class for each width and
    their sum keep the choice, at every row count, the same for the fused matmul as for the
    two apart (so the bits on the GPU too)."""
    def qmv_class(width: int) -> int:
        return sum(max(input_width, width) > limit for limit in METAL_QMV_CLASSES)

    total = sum(widths)
    return (all(w % METAL_TILE == 0 for w in widths)
            and len({qmv_class(w) for w in (*widths, total)}) == 1)
