"""Byte sizes as users write them: one grammar for every flag and argument that takes one
(`--expert-memory` / `expert_memory=`, the server's `--kv-budget`, `--prompt-cache-bytes` and
`--max-image-bytes`, the converter's `--shard-size`, `mlx_v41.inspect --memory` and
`--ssd-bandwidth`).

A number (a decimal point and an exponent allowed), then an optional unit in any case: B; K,
M, G, T or KB, MB, GB, TB (powers of 1000, as mlx-lm's sizes and disk makers'); KiB, MiB,
GiB, TiB (powers of 1024). So "48GB", "40GiB", "1.5K", "1e9" and "4096" are sizes.
"""

from __future__ import annotations

import math
import re

UNITS = {"": 1, "b": 1,
         **{f"{p}{b}": 1000 ** (i + 1) for i, p in enumerate("kmgt") for b in ("", "b")},
         **{f"{p}ib": 1024 ** (i + 1) for i, p in enumerate("kmgt")}}
EXAMPLES = "e.g. 48GB, 512MiB, 1e9, 4096"
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?(?:[eE]\+?\d+)?)\s*([A-Za-z]*)\s*")


def parse_size(text: str) -> int:
    """Bytes that `text` names (rounded down), or a ValueError: "'12XB' is not a size (e.g.
    48GB, 512MiB, 1e9, 4096)"."""
    m = _SIZE.fullmatch(str(text))
    unit = m.group(2).lower() if m else None
    value = float(m.group(1)) * UNITS[unit] if unit in UNITS else math.inf
    if not value < math.inf:
        raise ValueError(f"{text!r} is not a size ({EXAMPLES})")
    return int(value)
