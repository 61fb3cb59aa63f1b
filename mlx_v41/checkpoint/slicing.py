"""One rank's share of a tensor (tensor parallel, `mlx_v41.distributed.tensor`), as slices of
the published tensors (read from the memory map before the copy, so only the share is ever
resident) and of a converted folder's arrays (mxfp8 / mxfp4 / affine words and scales).

A `Shard` names a module's axis in logical elements: "lead" (experts of a SwitchLinear,
groups of a GroupedLinear, the rows of a plain vector), "out" (output rows N of a linear) or
"in" (input columns K). Published FP8 weights are [N, K] E4M3 bytes with [N/32, K/32] scales,
FP4 experts [N, K/2] bytes with [N, K/32] scales; MLX's packed weights are [..., N, K*bits/32]
uint32 words with [..., N, K/group] scales (and biases).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..numerics.quant import WEIGHT_BLOCK
from ..errors import CheckpointError

ALL = slice(None)


@dataclass(frozen=True)
class Shard:
    axis: str    # "lead", "out" or "in"
    start: int   # first element of the share (logical units)
    stop: int    # one past its last
    total: int   # the full size along the axis


def _blocks(shard: Shard, size: int, name: str) -> slice:
    """The share in blocks of `size` elements (a scale's rows or columns)."""
    if shard.start % size or (shard.stop % size and shard.stop != shard.total):
        raise CheckpointError(f"tensor {name}: the share {shard.start}:{shard.stop} does not "
                              f"fall on its {size}-element scale blocks")
    return slice(shard.start // size, -(-shard.stop // size))


def published_fp8(shard: Shard, base: str, rows_per_lead: int = 0) -> tuple:
    """(weight index, scale index) into a published FP8 [N, K] weight and its block scale;
    "lead" is whole output groups of `rows_per_lead` rows (wo_a)."""
    if shard.axis == "lead":
        shard = Shard("out", shard.start * rows_per_lead, shard.stop * rows_per_lead,
                      shard.total * rows_per_lead)
    part = slice(shard.start, shard.stop)
    blocks = _blocks(shard, WEIGHT_BLOCK, base)
    if shard.axis == "out":
        return (part, ALL), (blocks, ALL)
    return (ALL, part), (ALL, blocks)


def published_plain(shard: Shard, base: str) -> tuple:
    if shard.axis != "lead":
        raise CheckpointError(f"tensor {base}: a plain tensor shards along its first axis only")
    return (slice(shard.start, shard.stop),)


def converted(shard: Shard, leaf: str, module, key: str) -> tuple:
    """Index into a converted array `leaf` ("weight", "scales", "biases", or a plain
    parameter) of `module` for the share."""
    part = slice(shard.start, shard.stop)
    if shard.axis == "lead":
        return (part,)
    if shard.axis == "out":
        return (Ellipsis, part, ALL)
    if leaf == "weight":  # K packed bits/32 to a uint32 word
        if 32 % module.bits:
            raise CheckpointError(f"tensor {key}: {module.bits}-bit words do not split along "
                                  "the input (tensor parallel needs 2, 4 or 8 bits here)")
        per_word = 32 // module.bits
        return (Ellipsis, _blocks(shard, per_word, key))
    return (Ellipsis, _blocks(shard, module.group_size, key))
