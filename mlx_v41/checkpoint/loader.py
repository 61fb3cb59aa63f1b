"""Strict loading of the published checkpoint layout into `Model`.

One declarative rename table maps published names to module paths, with the storage kind of
each tensor; a named drop list gives the reason for every tensor not used. Every published
tensor is used or dropped, every model parameter is filled, and shapes and dtypes are checked;
any failure names the tensor. FP8/FP4 weights stay packed (mxfp8 / mxfp4).
"""

from __future__ import annotations

import functools
import json
import re
import struct
from collections import defaultdict
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from ..model.engram import EngramRows, EngramTable
from ..model.expert_reader import Region
from ..numerics.quant import fp4_to_mxfp4, fp8_blocks_to_mxfp8
from . import slicing
from ..errors import CheckpointError
from .placement import WHOLE, Placement
from .safetensors_io import SafetensorsFile

# Storage kinds: "plain" (BF16/F32, cast to the parameter dtype), "fp8" (F8_E4M3 weight +
# F8_E8M0 32x32 block scale), "fp8_grouped" (fp8 split into output groups: wo_a),
# "fp4_expert" (I8 packed FP4 + per-32 scale, stacked over experts), "fp8_rows" (Engram table).
L = r"layers\.(\d+)\."
RENAMES = [
    (r"embed\.weight", "model.embed_tokens.weight", "plain"),
    (r"head\.weight", "lm_head.weight", "plain"),
    (r"norm\.weight", "model.norm.weight", "plain"),
    (L + r"attn_norm\.weight", r"model.layers.\1.input_layernorm.weight", "plain"),
    (L + r"ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight", "plain"),
    (L + r"hc_attn_(fn|base|scale)", r"model.layers.\1.attn_hc.\2", "plain"),
    (L + r"hc_ffn_(fn|base|scale)", r"model.layers.\1.ffn_hc.\2", "plain"),
    (L + r"attn\.attn_sink", r"model.layers.\1.self_attn.sinks", "plain"),
    (L + r"attn\.wq_a", r"model.layers.\1.self_attn.q_a_proj", "fp8"),
    (L + r"attn\.q_norm\.weight", r"model.layers.\1.self_attn.q_a_norm.weight", "plain"),
    (L + r"attn\.wq_b", r"model.layers.\1.self_attn.q_b_proj", "fp8"),
    (L + r"attn\.wkv", r"model.layers.\1.self_attn.kv_proj", "fp8"),
    (L + r"attn\.kv_norm\.weight", r"model.layers.\1.self_attn.kv_norm.weight", "plain"),
    (L + r"attn\.wo_a", r"model.layers.\1.self_attn.o_a_proj", "fp8_grouped"),
    (L + r"attn\.wo_b", r"model.layers.\1.self_attn.o_b_proj", "fp8"),
    (L + r"attn\.compressor\.wkv\.weight", r"model.layers.\1.self_attn.compressor.kv_proj.weight",
     "plain"),
    (L + r"attn\.compressor\.wgate\.weight",
     r"model.layers.\1.self_attn.compressor.gate_proj.weight", "plain"),
    (L + r"attn\.compressor\.norm\.weight", r"model.layers.\1.self_attn.compressor.kv_norm.weight",
     "plain"),
    (L + r"attn\.indexer\.wq_b", r"model.layers.\1.self_attn.indexer.q_b_proj", "fp8"),
    (L + r"attn\.indexer\.weights_proj\.weight",
     r"model.layers.\1.self_attn.indexer.weights_proj.weight", "plain"),
    (L + r"attn\.indexer\.wk\.weight", r"model.layers.\1.self_attn.indexer.k_proj.weight", "plain"),
    (L + r"attn\.indexer\.k_norm\.weight", r"model.layers.\1.self_attn.indexer.k_norm.weight",
     "plain"),
    (L + r"ffn\.gate\.weight", r"model.layers.\1.mlp.gate.weight", "plain"),
    (L + r"ffn\.gate\.bias", r"model.layers.\1.mlp.gate.e_score_correction_bias", "plain"),
    (L + r"ffn\.gate\.bias_vl", r"model.layers.\1.mlp.gate.bias_vl", "plain"),
    (L + r"ffn\.experts\.(\d+)\.w1", r"model.layers.\1.mlp.experts.switch_mlp.gate_proj",
     "fp4_expert"),
    (L + r"ffn\.experts\.(\d+)\.w3", r"model.layers.\1.mlp.experts.switch_mlp.up_proj",
     "fp4_expert"),
    (L + r"ffn\.experts\.(\d+)\.w2", r"model.layers.\1.mlp.experts.switch_mlp.down_proj",
     "fp4_expert"),
    (L + r"ffn\.shared_experts\.w1", r"model.layers.\1.mlp.shared_experts.gate_proj", "fp8"),
    (L + r"ffn\.shared_experts\.w3", r"model.layers.\1.mlp.shared_experts.up_proj", "fp8"),
    (L + r"ffn\.shared_experts\.w2", r"model.layers.\1.mlp.shared_experts.down_proj", "fp8"),
    (L + r"engram\.embed", r"model.layers.\1.engram.embed", "fp8_rows"),
    (L + r"engram\.wkv", r"model.layers.\1.engram.kv_proj", "fp8"),
    (L + r"engram\.(q_weight|k_weight)", r"model.layers.\1.engram.\2", "plain"),
]
M = r"mtp\.(\d+)\."


def _stage_renames() -> list:
    """A DSpark stage's tensors carry a backbone layer's names (no compressor, indexer or
    Engram) under `mtp.S.`; they load into `dspark.stages.S`."""
    skip = ("compressor", "indexer", "engram")
    return [(M + p[len(L):], t.replace("model.layers.", "dspark.stages.", 1), k)
            for p, t, k in RENAMES if p.startswith(L) and not any(w in p for w in skip)]


DSPARK_RENAMES = _stage_renames() + [
    (r"mtp\.0\.main_proj", "dspark.main_proj", "fp8"),
    (r"mtp\.0\.main_norm\.weight", "dspark.main_norm.weight", "plain"),
    (r"mtp\.2\.norm\.weight", "dspark.norm.weight", "plain"),
    (r"mtp\.2\.markov_head\.(embed|head)\.weight", r"dspark.markov_head.\1", "plain"),
    (r"mtp\.2\.confidence_head\.proj\.weight", "dspark.confidence_head.proj", "plain"),
]


def dspark_renames(index) -> list:
    """`DSPARK_RENAMES` for the checkpoint's stage count: the heads (norm, Markov,
    confidence) sit on the last stage, `mtp.2.` in the published 3-stage layout."""
    stages = [int(m.group(1)) for name in index if (m := re.match(M, name))]
    last = max(stages, default=2)
    return [(p.replace(r"mtp\.2\.", rf"mtp\.{last}\."), t, k) for p, t, k in DSPARK_RENAMES]


# The vision tower keeps its published names (BF16 everywhere).
VISION_RENAMES = [
    (r"(vision\..+)", r"\1", "plain"),
    (r"(aligner\.w[12]\.(weight|bias))", r"\1", "plain"),
    (r"(image_(start|end|newline))", r"\1", "plain"),
]
# (pattern, reason, group): unless told to drop a group, the converter converts the dspark
# group like the backbone (`plan(dspark=True)`) and copies the vision group verbatim.
DROPS = [
    (r"mtp\..*", "DSpark drafter (7.93 GB at full size): not loaded (dspark=False)", "dspark"),
    (r"(vision|aligner)\..*", "vision tower (0.49 B parameters): not loaded (vision=False)",
     "vision"),
    (r"image_(start|end|newline)", "vision delimiters: not loaded (vision=False)", "vision"),
]
E8M0_NAN = 255  # E8M0 NaN: never valid in a scale, so a load error
PAIRED = {"fp8", "fp8_grouped", "fp4_expert", "fp8_rows"}  # stored as .weight + .scale
EXPECTED_DTYPES = {
    "plain": {"BF16", "F32"}, "fp8": {"F8_E4M3"}, "fp8_grouped": {"F8_E4M3"},
    "fp8_rows": {"F8_E4M3"}, "fp4_expert": {"I8", "U8"},
}


def data_start(path) -> int:
    """Byte offset of a safetensors file's payload (after the 8-byte length and the header)."""
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def read_index(folder: Path) -> dict:
    """tensor name -> shard path, from the index json (or a single model.safetensors)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise CheckpointError(f"{index}: not a valid safetensors index") from None
        if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: weight_map must map tensor names to shard files")
        paths = {shard: folder / shard for shard in set(weight_map.values())}  # one Path each
        return {name: paths[shard] for name, shard in weight_map.items()}
    single = folder / "model.safetensors"
    if single.is_file():
        return {name: single for name in SafetensorsFile(single).keys()}
    raise CheckpointError(f"{folder}: no model.safetensors.index.json or model.safetensors")


@functools.lru_cache(maxsize=16)
def _compiled(table: tuple) -> tuple:
    """A rename table's patterns compiled, each target template split at its back-references
    (a checkpoint has up to ~100K tensors: the plan matches each one)."""
    return tuple((re.compile(p), re.split(r"\\(\d)", t), k) for p, t, k in table)


def _expand(m: re.Match, parts: list) -> str:
    """`m.expand(template)` of a template split by `_compiled` (without re-parsing it)."""
    return "".join(part if i % 2 == 0 else m.group(int(part)) for i, part in enumerate(parts))


def _match(name: str, renames: tuple):
    """(match, target template parts, kind, base name) of the first rename (`_compiled`) a
    published tensor name takes, or None."""
    base = name[:-len(".scale")] if name.endswith(".scale") else name
    base = base[:-len(".weight")] if base.endswith(".weight") and not any(
        c.fullmatch(base) for c, _, _ in renames) else base
    for pattern, target, kind in renames:
        m = pattern.fullmatch(base)
        if m and (kind in PAIRED or base == name):
            return m, target, kind, base
    return None


class _Shards:
    def __init__(self, index: dict):
        self.index, self.files = index, {}

    def file(self, name) -> SafetensorsFile:
        if name not in self.index:
            raise CheckpointError(f"tensor {name} is missing from the checkpoint index")
        path = self.index[name]
        if path not in self.files:
            self.files[path] = SafetensorsFile(path)
        f = self.files[path]
        if name not in f.entries:
            raise CheckpointError(f"{path}: tensor {name} named in the index is absent")
        return f

    def get(self, name, kind, index=None, check: bool = True) -> mx.array:
        """A tensor (its `index` slice), its dtype checked, and a scale's bytes checked for
        the E8M0 NaN (at once, or with `deferred` set in `check_deferred`; `check=False`:
        the caller checks them, e.g. `_stack_experts` all of a projection's at once)."""
        f = self.check_dtype(name, kind)
        value = self.read(f, name) if index is None else self.read(f, name, index)
        if name.endswith(".scale") and check and self.checks_values and value.size:
            if self.deferred is None:
                nan_scale_check([(f.path, name, mx.max(value))])
            else:
                self.deferred.append((f.path, name, mx.max(value)))
        return value

    checks_values = True  # False for a header-only pass (the converter's dry run)
    # A list: scales are checked together by `check_deferred` (one evaluation for a whole
    # load, not one per tensor); None: each when read.
    deferred = None

    def check_deferred(self) -> None:
        """The E8M0 NaN check of every scale read since `deferred` was set."""
        if self.deferred:
            pending, self.deferred = self.deferred, []
            peaks = mx.stack([peak for _, _, peak in pending]).tolist()
            nan_scale_check([(path, name, peak) for (path, name, _), peak in zip(pending, peaks)])

    def check_dtype(self, name, kind) -> SafetensorsFile:
        f = self.file(name)
        allowed = {"F8_E8M0"} if name.endswith(".scale") else EXPECTED_DTYPES[kind]
        if f.dtype(name) not in allowed:
            raise CheckpointError(f"{f.path}: tensor {name} has dtype {f.dtype(name)}, "
                                  f"expected {'/'.join(sorted(allowed))}")
        return f

    def read(self, f: SafetensorsFile, name: str, index=None) -> mx.array:
        return f.get(name, index)


def nan_scale_check(scales: list) -> None:
    """CheckpointError naming the first of the scale tensors `scales` [(file, name, largest
    byte: an int or a scalar array)] that holds the E8M0 NaN."""
    for path, name, peak in scales:
        if int(peak) == E8M0_NAN:
            raise CheckpointError(f"{path}: tensor {name} holds the E8M0 NaN byte 255")


def has_group(index: dict, group: str) -> bool:
    """Whether the checkpoint holds tensors of a drop group ("dspark", "vision")."""
    return any(re.fullmatch(p, name) for p, _, g in DROPS if g == group for name in index)


def plan(index: dict, dspark: bool = False, vision: bool = False) -> tuple[dict, dict]:
    """Sort every published tensor into (used: target -> [(kind, base, match)], dropped);
    `dspark` loads the drafter's `mtp.*` tensors and `vision` the tower's instead of
    dropping them."""
    used, dropped = defaultdict(list), {}
    loaded = {g for g, on in (("dspark", dspark), ("vision", vision)) if on}
    drops = [(re.compile(p), why) for p, why, group in DROPS if group not in loaded]
    renames = _compiled(tuple(RENAMES + (dspark_renames(index) if dspark else []) +
                              (VISION_RENAMES if vision else [])))
    for name in sorted(index):
        reason = next((why for p, why in drops if p.fullmatch(name)), None)
        if reason:
            dropped[name] = reason
            continue
        hit = _match(name, renames)
        if hit is None:
            raise CheckpointError(f"unknown tensor {name} in the checkpoint")
        m, target, kind, base = hit
        if name.endswith(".scale") and kind in PAIRED:
            continue
        used[_expand(m, target)].append((kind, base, m))
    return used, dropped


def published_name(param: str):
    """The published tensor a model parameter loads from (the rename tables read backwards),
    or None where one parameter gathers several tensors (stacked experts)."""
    for pattern, template, kind in RENAMES + DSPARK_RENAMES + VISION_RENAMES:
        # The template's back-references \N match the parameter's path components; their values
        # fill the pattern's groups in order (an expert id, which the template drops, cannot).
        parts = re.split(r"\\(\d)", template)
        target = "".join(re.escape(p) if i % 2 == 0 else f"(?P<g{p}>[^.]+)"
                         for i, p in enumerate(parts))
        m = re.fullmatch(target + (r"\.(weight|scales|biases)" if kind in PAIRED else ""), param)
        values = [m.groupdict().get(f"g{i + 1}") for i in range(pattern.count("("))] if m else []
        if m is None or None in values:
            continue
        name = re.sub(r"\([^)]*\)", lambda _: values.pop(0), pattern).replace("\\.", ".")
        if re.fullmatch(pattern, name):  # the values fit the groups (fn|base|scale) etc.
            return name + ".weight" if kind in PAIRED else name
    return None


def missing_error(folder, missing: list) -> CheckpointError:
    """Parameters no tensor filled, named with the published tensor they need."""
    tensor = published_name(missing[0])
    what = f"{tensor} for parameter" if tensor else "for parameter"
    skip = "; dspark=False loads without the drafter" if missing[0].startswith("dspark.") \
        else ""
    return CheckpointError(f"{folder}: no checkpoint tensor {what} {missing[0]} "
                           f"({len(missing)} missing{skip})")


def no_vision(folder, why: str) -> CheckpointError:
    return CheckpointError(f"no vision tower (vision.*, aligner.*, image_* tensors) in {folder}: "
                           f"{why}; load with vision=False")


def no_dspark(folder, why: str) -> CheckpointError:
    return CheckpointError(f"no DSpark tensors (mtp.*) in {folder}: {why}; load with "
                           "dspark=False")


def _convert(shards: _Shards, kind: str, entries: list, params: dict, target: str,
             shard=None) -> dict:
    """Published tensors of one target -> {parameter name: array}; `shard` (a
    `slicing.Shard`): only this rank's share of them is read."""
    if kind == "plain":
        (_, base, _), = entries
        return {target: shards.get(base, kind, shard and slicing.published_plain(shard, base))}
    if kind == "fp4_expert":
        return _stack_experts(shards, entries, params, target, shard)
    (_, base, _), = entries
    w_index = s_index = None
    if shard is not None:
        rows = params[f"{target}.weight"].shape[1] if kind == "fp8_grouped" else 0
        w_index, s_index = slicing.published_fp8(shard, base, rows)
    w = shards.get(f"{base}.weight", kind, w_index)
    s = shards.get(f"{base}.scale", kind, s_index)
    try:
        w, s = fp8_blocks_to_mxfp8(w, s)
    except ValueError as e:
        raise CheckpointError(f"tensor {base}: {e}") from None
    if kind == "fp8_grouped":
        groups = params[f"{target}.weight"].shape[0]
        w = w.reshape(groups, -1, w.shape[-1])
        s = s.reshape(groups, -1, s.shape[-1])
    return {f"{target}.weight": w, f"{target}.scales": s}


def _stack_experts(shards: _Shards, entries: list, params: dict, target: str,
                   shard=None) -> dict:
    """Stack experts 0..E-1 of one projection into mxfp4 `[E, N, K/8]` + scales (with a
    "lead" `shard`: only experts start..stop-1 are read)."""
    if shard is not None and shard.axis != "lead":
        raise CheckpointError(f"tensor {entries[0][1]}: routed experts shard by expert only")
    lo = 0 if shard is None else shard.start
    expected = params[f"{target}.weight"].shape[0] if shard is None else shard.total
    by_id = {int(m.group(2)): base for _, base, m in entries}
    extra = sorted(set(by_id) - set(range(expected)))
    if extra:
        raise CheckpointError(f"tensor {by_id[extra[0]]}: expert id {extra[0]} is outside "
                              f"0..{expected - 1}")
    for e in range(expected):
        if e not in by_id:
            base = entries[0][1].rsplit(".", 2)[0]
            raise CheckpointError(f"tensor {base}.{e}.{entries[0][1].rsplit('.', 1)[1]} "
                                  f"(routed expert {e} of {expected}) is missing")
    weights, scales, ids = [], [], range(lo, lo + params[f"{target}.weight"].shape[0])
    for e in ids:
        w = shards.get(f"{by_id[e]}.weight", "fp4_expert").view(mx.uint8)
        s = shards.get(f"{by_id[e]}.scale", "fp4_expert", check=False)
        for part, value, first in (("weight", w, weights), ("scale", s, scales)):
            if first and value.shape != first[0].shape:
                raise CheckpointError(f"tensor {by_id[e]}.{part} has shape {tuple(value.shape)},"
                                      f" unlike expert 0's {tuple(first[0].shape)}")
        weights.append(w)
        scales.append(s)
    stacked = mx.stack(scales)
    try:
        w, s = fp4_to_mxfp4(mx.stack(weights), stacked)
    except ValueError as e:
        raise CheckpointError(f"tensor {by_id[0]}: {e}") from None
    # Stacked now: the experts' separate copies are freed here, not at the end of the load
    # (which would hold every expert twice). Their scales' NaN check in the same evaluation.
    checked = shards.checks_values and stacked.size
    peaks = [mx.max(stacked.reshape(stacked.shape[0], -1), axis=1)] if checked else []
    mx.eval(w, s, *peaks)
    for e, peak in zip(ids, peaks[0].tolist() if checked else []):
        if peak == E8M0_NAN:
            name = f"{by_id[e]}.scale"
            nan_scale_check([(shards.file(name).path, name, peak)])
    return {f"{target}.weight": w, f"{target}.scales": s}


def convert_target(shards: _Shards, target: str, entries: list, params: dict,
                   cast: bool = True, shard=None) -> dict:
    """The published tensors of one target in the model's layout, checked against `params`;
    `cast=False` keeps plain tensors in their stored dtype (the converter's choice); `shard`:
    this rank's share only (tensor parallel)."""
    kind, source = entries[0][0], entries[0][1]
    out = {}
    for name, value in _convert(shards, kind, entries, params, target, shard).items():
        if name not in params:
            raise CheckpointError(f"tensor {source} maps to {name}, which this config "
                                  f"does not have")
        if tuple(value.shape) != tuple(params[name].shape):
            raise CheckpointError(f"tensor {source} has shape {tuple(value.shape)} after "
                                  f"conversion, expected {tuple(params[name].shape)} for {name}")
        out[name] = value.astype(params[name].dtype) if kind == "plain" and cast else value
    return out


def engram_tables(model) -> dict:
    """{module path: EngramTable} of the model."""
    return {name: m for name, m in model.named_modules() if isinstance(m, EngramTable)}


def check_table(shards: _Shards, table: EngramTable, base: str) -> tuple:
    """Dtype and shape checks of a published Engram table; -> (weight file, scale file)."""
    files = []
    for part, width in (("weight", table.head_dim), ("scale", table.head_dim // 32)):
        name = f"{base}.{part}"
        f = shards.check_dtype(name, "fp8_rows")
        if f.shape(name) != (table.rows, width):
            raise CheckpointError(f"tensor {name} has shape {f.shape(name)}, expected "
                                  f"{(table.rows, width)} (engram_num_embeddings, head_dim)")
        files.append(f)
    return tuple(files)


def _attach_table(shards: _Shards, table: EngramTable, base: str) -> None:
    """Memory-map a published table in place: rows are read only when looked up."""
    weight_file, scale_file = check_table(shards, table, base)
    regions = []
    for f, name in ((weight_file, f"{base}.weight"), (scale_file, f"{base}.scale")):
        begin = f.entries[name]["data_offsets"][0]
        regions.append((f.path, data_start(f.path) + begin, f.shape(name)))
    table.attach(EngramRows.from_regions([tuple(regions)]))


def expert_regions(shards: _Shards, streaming, target: str, entries: list, shard=None) -> None:
    """Where each routed expert of one projection `target` lies (a streamed load reads them
    when routed): its packed FP4 weight and E8M0 scale tensors, checked like a resident
    load's, are byte for byte the slots' mxfp4 weight and scales."""
    switch, _, proj = target.rpartition(".")
    count = streaming.count(switch)
    first = 0 if shard is None else shard.start
    by_id = {int(m.group(2)): base for _, base, m in entries}
    expected = count if shard is None else shard.total
    for e in range(expected):
        if e not in by_id:
            base = entries[0][1].rsplit(".", 2)[0]
            raise CheckpointError(f"tensor {base}.{e}.{entries[0][1].rsplit('.', 1)[1]} "
                                  f"(routed expert {e} of {expected}) is missing")
    for i in range(count):
        base = by_id[first + i]
        for suffix, leaf in ((".weight", "weight"), (".scale", "scales")):
            name = base + suffix
            f = shards.check_dtype(name, "fp4_expert")
            part = streaming.part(switch, proj, leaf)
            begin, end = f.entries[name]["data_offsets"]
            if end - begin != part.nbytes:
                raise CheckpointError(f"tensor {name} has shape {f.shape(name)}, unlike the "
                                      f"config's routed experts ({part.nbytes} bytes each)")
            streaming.add(switch, proj, leaf, i, Region(str(f.path), f.start + begin,
                                                        end - begin, name, leaf == "scales"))


def load_weights(model, folder, placement: Placement = WHOLE, experts=None) -> dict:
    """Fill `model` from a published-layout folder; returns {dropped tensor: reason}.

    Engram tables are memory-mapped (never copied into memory); everything else is loaded.
    `placement`: which tensors, and which share of each, this process reads (every one whole
    by default; a rank of a group passes its own). `experts(model)`: an `ExpertStreaming`
    whose routed experts stay in the files (their regions recorded), or None.
    """
    folder = Path(folder)
    index = read_index(folder)
    if "dspark" in model and not any(name.startswith("mtp.") for name in index):
        raise no_dspark(folder, "the checkpoint has none")
    if "vision" in model and not has_group(index, "vision"):
        raise no_vision(folder, "the checkpoint has none")
    used, dropped = plan(index, dspark="dspark" in model, vision="vision" in model)
    streaming = experts(model) if experts is not None else None
    params = dict(tree_flatten(model.parameters()))
    tables = engram_tables(model)
    shards = _Shards(index)
    shards.deferred = []
    loaded, attached = {}, set()
    streamed = {t for t, e in used.items() if e[0][0] == "fp4_expert" and streaming is not None
                and streaming.owns(t.rpartition(".")[0])}
    if placement.is_partial:  # other ranks' tensors stay unread
        used = {t: e for t, e in used.items()
                if t in params or f"{t}.weight" in params or t in tables or t in streamed}
    for target, entries in used.items():
        if target in streamed:
            expert_regions(shards, streaming, target, entries, placement.shard(target))
            continue
        if entries[0][0] == "fp8_rows":
            if target not in tables:
                raise CheckpointError(f"tensor {entries[0][1]} maps to {target}, which this "
                                      f"config does not have")
            _attach_table(shards, tables[target], entries[0][1])
            attached.add(target)
            continue
        loaded.update(convert_target(shards, target, entries, params,
                                     shard=placement.shard(target)))
    shards.check_deferred()
    missing = sorted(set(params) - set(loaded)) + sorted(set(tables) - attached)
    if missing:
        raise missing_error(folder, missing)
    model.update(tree_unflatten(list(loaded.items())))
    mx.eval(model.parameters())
    return dropped
