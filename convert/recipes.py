"""Conversion recipes: how each quantized module is stored (an mlx-lm `quantization` block:
top-level group_size/bits/mode plus per-module overrides keyed by module path) and the dtype
of the float tensors.

* official (default): the checkpoint's precision, repacked bit-exactly (FP8 32x32 blocks ->
  mxfp8, FP4 experts -> mxfp4); nothing is requantized.
* `-q`: every quantized module requantized from the dequantized official values.
* presets (`--quant-predicate mixed_E_8`): routed experts requantized to E bits, every other
  quantized module (attention, shared expert, indexer, Engram projection) kept at the official
  8-bit FP8.
The DSpark drafter's modules (`dspark.*`) follow the same rules as the backbone's.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx

from mlx_v41.model.layers import input_dims, is_quantized

from .source import ConvertError

# mlx-lm's defaults per mode: (group_size, bits)
MODE_DEFAULTS = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}
VALID = {"affine": ({2, 3, 4, 5, 6, 8}, {32, 64, 128}), "mxfp4": ({4}, {32}),
         "nvfp4": ({4}, {16}), "mxfp8": ({8}, {32})}
PRESETS = {"mixed_2_8": 2, "mixed_3_8": 3, "mixed_4_8": 4}  # routed-expert bits; the rest 8
DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
EXPERTS = ".mlp.experts.switch_mlp."
SLICE_BYTES = 64 * 1024 * 1024  # fp32 bytes dequantized at a time while requantizing


@dataclass
class Recipe:
    name: str
    layouts: dict                       # module path -> {group_size, bits, mode}
    official: dict                      # module path -> the checkpoint's layout
    dtype: Optional[str] = None         # storage dtype of the BF16 float tensors
    kept_official: list = field(default_factory=list)  # too narrow for the -q group size

    def is_requantized(self, path: str) -> bool:
        return self.layouts[path] != self.official[path]

    def quantization(self) -> dict:
        """The mlx-lm block: the most common layout on top, the others per module path."""
        counts = Counter(tuple(sorted(q.items())) for q in self.layouts.values())
        top = dict(counts.most_common(1)[0][0]) if counts else {}
        block = {"group_size": top.get("group_size"), "bits": top.get("bits"),
                 "mode": top.get("mode")}
        block.update({p: dict(q) for p, q in self.layouts.items() if q != top})
        return block

    def describe(self) -> dict:
        return {"name": self.name, "dtype": self.dtype,
                "requantized_modules": sum(map(self.is_requantized, self.layouts)),
                "kept_official": self.kept_official}


def layout(module) -> dict:
    return {"group_size": module.group_size, "bits": module.bits, "mode": module.mode}


def check_layout(q: dict) -> dict:
    bits, sizes = VALID[q["mode"]]
    if q["bits"] not in bits or q["group_size"] not in sizes:
        raise ConvertError(f"--q-mode {q['mode']} takes --q-bits {sorted(bits)} and "
                           f"--q-group-size {sorted(sizes)}, got {q['bits']} and "
                           f"{q['group_size']}")
    return q


def make_recipe(model, quantize: bool = False, q_bits: Optional[int] = None,
                q_group_size: Optional[int] = None, q_mode: str = "affine",
                quant_predicate: Optional[str] = None, dtype: Optional[str] = None) -> Recipe:
    """The recipe for the official-layout `model` skeleton from mlx-lm style settings."""
    if q_mode not in MODE_DEFAULTS:
        raise ConvertError(f"--q-mode must be one of {sorted(MODE_DEFAULTS)}, got {q_mode!r}")
    if dtype is not None and dtype not in DTYPES:
        raise ConvertError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if quant_predicate is not None and quant_predicate not in PRESETS:
        raise ConvertError(f"--quant-predicate must be one of {sorted(PRESETS)}, got "
                           f"{quant_predicate!r}")
    modules = {p: m for p, m in model.named_modules() if is_quantized(m)}
    official = {p: layout(m) for p, m in modules.items()}
    if not quantize and quant_predicate is None:
        if q_bits is not None or q_group_size is not None:
            raise ConvertError("--q-bits / --q-group-size need -q/--quantize")
        return Recipe("official", dict(official), official, dtype)
    default_group, default_bits = MODE_DEFAULTS[q_mode]
    if quant_predicate is not None:
        q_bits = PRESETS[quant_predicate] if q_bits is None else q_bits
    q = check_layout({"group_size": q_group_size or default_group,
                      "bits": q_bits or default_bits, "mode": q_mode})
    layouts, kept = {}, []
    for path, module in modules.items():
        wanted = quant_predicate is None or EXPERTS in path
        fits = input_dims(module) % q["group_size"] == 0
        layouts[path] = dict(q) if wanted and fits else official[path]
        if wanted and not fits:
            kept.append(path)
    name = quant_predicate or f"q{q['bits']}_{q['mode']}_g{q['group_size']}"
    return Recipe(name, layouts, official, dtype, kept)


def requantize(arrays: dict, source: dict, target: dict) -> list:
    """Packed weight/scales(/biases) in layout `source` -> [weight, scales(, biases)] in
    `target`, through the dequantized values (bf16, exact for FP8/FP4 with E8M0 scales);
    slices along the first axis bound the memory."""
    weight, scales, biases = arrays["weight"], arrays["scales"], arrays.get("biases")
    per_slice = 4 * weight.size // weight.shape[0] * 32 // source["bits"]
    step = max(1, SLICE_BYTES // per_slice)
    parts = []
    for i in range(0, weight.shape[0], step):
        values = mx.dequantize(weight[i:i + step], scales[i:i + step],
                               None if biases is None else biases[i:i + step],
                               dtype=mx.float32, **source).astype(mx.bfloat16)
        out = mx.quantize(values, **target)
        mx.eval(out)
        parts.append(out)
        del values
        mx.clear_cache()  # MLX keeps freed buffers for reuse; give them back between slices
    return [mx.concatenate(list(p)) if len(p) > 1 else p[0] for p in zip(*parts)]
