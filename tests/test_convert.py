"""mlx_v41.convert: the published checkpoint -> an MLX folder.

* official recipe: every parameter and Engram row of the converted model (the DSpark drafter
  included) equals the direct load's, on a checkpoint of arange-like bytes (a wrong split,
  transpose or nibble order fails array_equal), and the logits and drafts are equal;
* requantization recipes: weights within the format's error bound of the official values
  (stated per mode below), logits correlated with the source model's by a stated bound,
  lossless mxfp8 exactly equal; the drafter laid out like the backbone and its drafts
  correlated with the official drafter's by a stated bound;
* interruption (a killed subprocess) and resume, a corrupted finished file redone;
* every bad input: one line, exit status 1, nothing at --mlx-path;
* Engram tables memory-mapped after load_model, for a >= 2 GB (sparse) table.

The module runs on MLX's CPU backend (the `cpu` fixture), on the reference ops, where the
correlation bounds were measured.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlx_v41
import mlx_v41.convert.writer as writer
from checkpoint_factory import write_checkpoint
from mlx_v41.checkpoint.random_checkpoint import (Tensor, encode_bf16, engram_num_embeddings,
                                                  tiny_text_config)
from conftest import golden_checkpoint, reference_ops
from mlx_v41 import CheckpointError
from mlx_v41.convert import convert
from mlx_v41.convert.cli import main
from mlx_v41.checkpoint.converted import MANIFEST
from mlx_v41.checkpoint.safetensors_io import SafetensorsFile
from mlx_v41.model.engram_hash import build_token_map
from mlx_v41.model.layers import is_quantized
from shard_bytes import read_shard, write_shard

REPO = Path(__file__).resolve().parents[1]
GOLDEN = golden_checkpoint("tiny")
INDEX = "model.safetensors.index.json"
PROMPT = [0, 5, 9, 300, 17, 4, 4, 4, 100, 200, 300, 400, 7, 8, 9, 10]
QUIET = dict(progress=False, log=lambda line: None)
REAL_WRITE = writer._write

pytestmark = pytest.mark.usefixtures("cpu")


def load_model(path, dspark=None):
    """`mlx_v41.load_model` on the reference ops."""
    return reference_ops(mlx_v41.load_model(path, dspark=dspark))


@pytest.fixture(scope="module")
def golden_model():
    return load_model(GOLDEN)


@pytest.fixture(scope="module")
def golden_drafter():
    """The published checkpoint with its DSpark drafter."""
    return load_model(GOLDEN, dspark=True)


@pytest.fixture(scope="module")
def golden_logits(golden_model):
    return golden_model(mx.array([PROMPT]))


def params(model) -> dict:
    return dict(tree_flatten(model.parameters()))


def table_rows(model, layer: int):
    table = model.model.layers[layer].engram.embed
    return table.storage.gather(np.arange(table.rows))


def assert_same_weights(a, b) -> None:
    pa, pb = params(a), params(b)
    assert pa.keys() == pb.keys()
    for name in pa:
        assert pa[name].dtype == pb[name].dtype, name
        assert mx.array_equal(pa[name], pb[name]).item(), name
    for layer in a.cfg.engram_layer_ids:
        for x, y in zip(table_rows(a, layer), table_rows(b, layer)):
            assert np.array_equal(x, y), layer


# ---------------------------------------------------------------- official recipe

def arange_values(name: str, t: Tensor) -> Tensor:
    """The same tensor filled with a position-dependent pattern (no FP8 NaN codes)."""
    i = np.arange(t.data.size).reshape(t.data.shape)
    if t.dtype == "F8_E4M3":
        codes = i % 253
        return Tensor(t.dtype, (codes + (codes >= 0x7F)).astype(np.uint8))  # skip 0x7F
    if t.dtype == "F8_E8M0":
        return Tensor(t.dtype, (118 + i % 9).astype(np.uint8))
    if t.dtype == "I8":
        return Tensor(t.dtype, (i % 256).astype(np.uint8).view(np.int8))
    values = ((i % 4093) - 2046) / 1024.0
    return Tensor(t.dtype, encode_bf16(values) if t.dtype == "BF16" else values.astype(np.float32))


def test_official_recipe_is_a_bit_exact_repack(tmp_path):
    source = write_checkpoint(tmp_path / "hf", tiny_text_config(), edit=arange_values,
                              shard_count=6)
    out = convert(source, tmp_path / "mlx", shard_size=200_000, **QUIET)
    assert_same_weights(load_model(source, dspark=True), load_model(out, dspark=True))


def test_official_recipe_logits_equal_and_folder_layout(tmp_path, golden_model, golden_logits,
                                                        golden_drafter):
    out = convert(GOLDEN, tmp_path / "mlx", **QUIET)
    converted = load_model(out)
    assert mx.array_equal(converted(mx.array([PROMPT])), golden_logits).item()
    assert_same_weights(golden_model, converted)

    config = json.loads((out / "config.json").read_text())
    q = config["quantization"]
    assert (q["group_size"], q["bits"], q["mode"]) == (32, 8, "mxfp8")  # mlx-lm's form
    expert = "model.layers.0.mlp.experts.switch_mlp.gate_proj"
    assert q[expert] == {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    assert config["quantization_config"] == q
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["complete"] and manifest["recipe"]["name"] == "official"
    for name, info in manifest["files"].items():
        assert (out / name).stat().st_size == info["bytes"], name
    index = json.loads((out / INDEX).read_text())
    # The index lists the converted parameters; the vision tower stays verbatim in extras/.
    tower = ("vision.", "aligner.", "image_")
    assert set(index["weight_map"]) == {p for p in params(golden_drafter)
                                        if not p.startswith(tower)}
    for name in ("tokenizer.json", "tokenizer_config.json", "README.md"):
        assert (out / name).is_file()
    token_map = np.load(out / manifest["engram"]["token_map"])
    assert np.array_equal(token_map, build_token_map(GOLDEN / "tokenizer.json", 308))
    extras = {p.name.split("-")[0] for p in (out / "extras").iterdir()}
    assert extras == {"vision"}
    assert manifest["dspark"] == [p.name for p in sorted(out.glob("dspark-*.safetensors"))]
    assert not (tmp_path / "mlx.partial").exists()


def test_extras_are_byte_exact_and_drop_flags(tmp_path):
    out = convert(GOLDEN, tmp_path / "all", **QUIET)
    names = json.loads((GOLDEN / INDEX).read_text())["weight_map"]
    kept = {}
    for path in (out / "extras").iterdir():
        kept.update(mx.load(str(path)))
    assert {n for n in names if n.startswith(("vision.", "aligner.", "image_"))} == set(kept)
    name = "vision.blocks.0.attn.wqkv.weight"
    raw = SafetensorsFile(GOLDEN / names[name])
    assert np.array_equal(np.array(kept[name].view(mx.uint16)), raw.numpy(name))
    slim = convert(GOLDEN, tmp_path / "slim", drop_vision=True, drop_dspark=True, **QUIET)
    assert not (slim / "extras").exists()
    manifest = json.loads((slim / MANIFEST).read_text())
    assert manifest["sizes"]["extras"] == 0 and manifest["sizes"]["weights"] > 0
    assert mx.array_equal(load_model(slim)(mx.array([PROMPT])),
                          load_model(out)(mx.array([PROMPT]))).item()


def test_small_shards_and_split_tables(tmp_path, golden_logits):
    out = convert(GOLDEN, tmp_path / "mlx", shard_size=12_000, drop_vision=True,
                  drop_dspark=True, **QUIET)
    manifest = json.loads((out / MANIFEST).read_text())
    table = manifest["engram"]["tables"]["model.layers.1.engram.embed"]
    assert len(table["files"]) > 1 and sum(f["rows"] for f in table["files"]) == table["rows"]
    assert mx.array_equal(load_model(out)(mx.array([PROMPT])), golden_logits).item()


def test_dtype_sets_float_storage(tmp_path, golden_logits):
    out = convert(GOLDEN, tmp_path / "f32", dtype="float32", drop_vision=True,
                  drop_dspark=True, **QUIET)
    stored = {}
    for name in json.loads((out / MANIFEST).read_text())["weights"]:
        stored.update(mx.load(str(out / name)))
    assert stored["model.embed_tokens.weight"].dtype == mx.float32        # was BF16
    assert stored["model.layers.0.attn_hc.fn"].dtype == mx.float32        # F32 stays
    assert stored["model.layers.0.self_attn.q_a_proj.weight"].dtype == mx.uint32
    # bf16 -> f32 is exact and the model computes in its own dtypes.
    assert mx.array_equal(load_model(out)(mx.array([PROMPT])), golden_logits).item()


# ---------------------------------------------------------------- requantization recipes

def test_requantize_to_mxfp8_is_lossless(tmp_path, golden_logits):
    # FP8 blocks and FP4 experts are both exactly representable in mxfp8: the whole
    # dequantize -> quantize -> load path must reproduce the logits exactly.
    out = convert(GOLDEN, tmp_path / "mlx", quantize=True, q_mode="mxfp8", drop_vision=True,
                  drop_dspark=True, **QUIET)
    assert json.loads((out / "config.json").read_text())["quantization"]["mode"] == "mxfp8"
    assert mx.array_equal(load_model(out)(mx.array([PROMPT])), golden_logits).item()


def dequantized(module) -> mx.array:
    return mx.dequantize(module.weight, module.scales, module.get("biases"),
                         group_size=module.group_size, bits=module.bits, mode=module.mode,
                         dtype=mx.float32)


def weight_bound(official: mx.array, module) -> mx.array:
    """Largest error per group: affine, 1.5 steps (rounding plus the bf16 rounding of scale and
    bias) + 2^-8 of the group's largest magnitude; FP4 modes, a quarter of it (half the
    widest E2M1 gap, with the power-of-two scale's headroom)."""
    groups = official.reshape(*official.shape[:-1], -1, module.group_size)
    amax = mx.abs(groups).max(-1)
    if module.mode == "affine":
        step = (groups.max(-1) - groups.min(-1)) / (2 ** module.bits - 1)
        return 1.5 * step + amax * 2 ** -8
    return amax / 4


# recipe -> (convert kwargs, lower bound on the mean cosine similarity of the requantized
# model's logit rows over PROMPT with the source model's). The tiny random model amplifies
# weight noise (its layer 0 alone at 8 bits moves the logits by ~45%; FP8 activation rounding
# and top-k routing are discontinuous), so the requantized logits keep only part of the
# source's direction and the weight bounds are the tight check. Measured: 0.85 / 0.51 / 0.58 /
# 0.42; an all-zero model scores 0 and the source model's logits of the reversed prompt -0.02.
RECIPES = {
    "affine8": (dict(quantize=True, q_bits=8), 0.7),
    "affine4_g32": (dict(quantize=True, q_group_size=32), 0.35),
    "mixed_3_8": (dict(quant_predicate="mixed_3_8"), 0.4),
    "mxfp4": (dict(quantize=True, q_mode="mxfp4"), 0.3),
}


def mean_cosine(logits: mx.array, reference: mx.array) -> float:
    """Mean over positions of the cosine similarity of logit rows [.., V]; 0 for a zero row."""
    dot = mx.sum(logits * reference, axis=-1)
    norms = mx.linalg.norm(logits, axis=-1) * mx.linalg.norm(reference, axis=-1)
    return mx.mean(mx.where(norms > 0, dot / mx.maximum(norms, 1e-30), 0.0)).item()


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_requantize_recipes_within_bounds(tmp_path, golden_model, golden_logits, recipe):
    kwargs, min_cosine = RECIPES[recipe]
    out = convert(GOLDEN, tmp_path / "mlx", drop_vision=True, drop_dspark=True, **kwargs,
                  **QUIET)
    model = load_model(out)
    official = dict(golden_model.named_modules())
    requantized = 0
    for path, module in model.named_modules():
        if not is_quantized(module):
            continue
        expected = "mxfp8" if recipe == "mixed_3_8" and ".switch_mlp." not in path else None
        if expected:
            assert module.mode == expected and mx.array_equal(
                module.weight, official[path].weight).item(), path
            continue
        requantized += 1
        reference = dequantized(official[path])
        error = mx.abs(dequantized(module) - reference)
        error = error.reshape(*error.shape[:-1], -1, module.group_size).max(-1)
        assert mx.all(error <= weight_bound(reference, module)).item(), path
    assert requantized >= 36
    assert mean_cosine(model(mx.array([PROMPT])), golden_logits) >= min_cosine


def test_mixed_preset_prints_its_size(tmp_path, capsys):
    assert main(["--hf-path", str(GOLDEN), "--mlx-path", str(tmp_path / "m"),
                 "--quant-predicate", "mixed_2_8", "--dry-run", "--quiet"]) == 0
    out = capsys.readouterr().out
    # 36 backbone expert projections + 9 of the drafter's (3 stages); 139 + 34 drafter modules
    assert "recipe mixed_2_8: 45 of 173 quantized modules requantized" in out
    assert "output:" in out and "weights" in out and "DSpark drafter" in out
    assert not (tmp_path / "m").exists()


# ---------------------------------------------------------------- the DSpark drafter

def draft_logits(model, forced=None) -> tuple:
    """A draft pass for 4 sets of random taps [1, 12, 3 * hidden] bf16 (rings seeded with their
    main_x, as a target forward commits them) -> (tokens [4, block + 1], logits [4, block, V]).
    `forced` tokens drive the Markov chain, so two drafters score the same drafts."""
    cfg, drafter = model.cfg, model.dspark
    tokens, logits = [], []
    for seed in range(4):
        taps = mx.random.normal((1, 12, 3 * cfg.hidden_size), key=mx.random.key(seed))
        main_x = drafter.main_x([taps.astype(mx.bfloat16)])
        rings = model.make_cache()[cfg.num_hidden_layers:]
        drafter.write_rings(rings, main_x, 0)
        for ring in rings:
            ring.offset = ring.window.end
        chain = None if forced is None else iter(forced[seed, 1:].tolist())
        sample = None if chain is None else (lambda row: mx.array([next(chain)]))
        t, row_logits, _ = drafter.draft(model.model.embed_tokens, model.lm_head.weight,
                                         mx.array([7 + seed]), rings, sample=sample)
        tokens.append(t)
        logits.append(row_logits)
    return mx.concatenate(tokens), mx.concatenate(logits)


def test_official_recipe_converts_the_drafter_bit_exactly(tmp_path, golden_drafter):
    out = convert(GOLDEN, tmp_path / "mlx", drop_vision=True, **QUIET)
    converted = load_model(out)                         # the drafter loads by default
    assert "dspark" not in load_model(out, dspark=False)
    ours, published = params(converted.dspark), params(golden_drafter.dspark)
    assert ours.keys() == published.keys() and len(ours) > 100
    for name in published:
        assert ours[name].dtype == published[name].dtype, name
        assert mx.array_equal(ours[name], published[name]).item(), name
    for a, b in zip(draft_logits(converted), draft_logits(golden_drafter)):
        assert mx.array_equal(a, b).item()


# recipe -> (convert kwargs, lower bound on the mean cosine similarity of the requantized
# drafter's logit rows with the official drafter's, both on the official drafts' Markov chain,
# over 4 random tap sets). Measured: 0.968 / 0.864. On mixed_3_8, other taps' official drafts
# on the same chain score 0.41 (the chain's Markov term), zeroed draft experts 0.16, stage 0/1
# experts swapped 0.29, stage 2's down_proj experts in reverse order 0.78, main_proj rows
# reversed 0.47.
DRAFT_RECIPES = {
    "affine8": (dict(quantize=True, q_bits=8), 0.93),
    "mixed_3_8": (dict(quant_predicate="mixed_3_8"), 0.82),
}


def layout_of(module) -> tuple:
    return module.mode, module.bits, module.group_size


@pytest.mark.parametrize("recipe", sorted(DRAFT_RECIPES))
def test_requantized_drafter_is_laid_out_like_the_backbone(tmp_path, golden_drafter, recipe):
    kwargs, min_cosine = DRAFT_RECIPES[recipe]
    out = convert(GOLDEN, tmp_path / "mlx", drop_vision=True, **kwargs, **QUIET)
    model = load_model(out, dspark=True)
    modules = dict(model.named_modules())
    official = dict(golden_drafter.named_modules())
    expert = layout_of(modules["model.layers.0.mlp.experts.switch_mlp.gate_proj"])
    assert expert != ("mxfp4", 4, 32)                         # requantized
    drafted = [p for p, m in modules.items() if p.startswith("dspark.") and is_quantized(m)]
    assert len(drafted) == 34
    for path in drafted:
        stage_path = path.split(".", 3)[-1] if ".stages." in path else "self_attn.q_a_proj"
        backbone = modules[f"model.layers.0.{stage_path}"]
        assert layout_of(modules[path]) == layout_of(backbone), path
        if layout_of(modules[path]) != layout_of(official[path]):
            reference = dequantized(official[path])
            error = mx.abs(dequantized(modules[path]) - reference)
            error = error.reshape(*error.shape[:-1], -1, modules[path].group_size).max(-1)
            assert mx.all(error <= weight_bound(reference, modules[path])).item(), path
    tokens, expected = draft_logits(golden_drafter)
    assert mean_cosine(draft_logits(model, forced=tokens)[1], expected) >= min_cosine


def test_dropped_drafter_is_absent_and_refused(tmp_path, capsys):
    out = convert(GOLDEN, tmp_path / "mlx", drop_dspark=True, **QUIET)
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["dspark"] == [] and manifest["sizes"]["dspark"] == 0
    assert not list(out.glob("dspark-*")) and not (out / "extras" / "dspark").exists()
    with pytest.raises(CheckpointError) as info:
        load_model(out, dspark=True)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"no DSpark tensors (mtp.*) in {out}")
    assert "load with dspark=False" in message
    assert "dspark" not in load_model(out)              # by default: the backbone alone


# ---------------------------------------------------------------- interruption and resume

KILLER = r"""
import os, signal, sys
import mlx_v41.convert.writer as writer
from mlx_v41.convert.cli import main

calls, original = [0], writer._write
def write_then_die(handle, block):
    calls[0] += 1
    if calls[0] == int(sys.argv[1]):        # mid-way through a file: half a block, then kill
        original(handle, bytes(block)[:len(block) // 2])
        handle.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    original(handle, block)
writer._write = write_then_die
main(sys.argv[2:])
"""


def cli(*args, env_extra=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]),
           **(env_extra or {})}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=300)


def folder_bytes(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in folder.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_killed_conversion_resumes_to_the_same_output(tmp_path):
    out, args = tmp_path / "mlx", ["--hf-path", str(GOLDEN), "--shard-size", "100KB",
                                   "--quiet"]
    killed = cli("-c", KILLER, "40", *args, "--mlx-path", str(out))
    assert killed.returncode == -signal.SIGKILL
    partial = tmp_path / "mlx.partial"
    finished = json.loads((partial / MANIFEST).read_text())["files"]
    assert 0 < len(finished) and list(partial.glob("*.incomplete"))
    assert not out.exists()
    with pytest.raises((CheckpointError, mlx_v41.ConfigError)):
        load_model(partial)

    resumed = cli("-m", "mlx_v41.convert", *args, "--mlx-path", str(out))
    assert resumed.returncode == 0, resumed.stderr
    assert f"{len(finished)} of" in resumed.stdout and "already written" in resumed.stdout
    assert not partial.exists()
    clean = convert(GOLDEN, tmp_path / "clean", shard_size=100_000, **QUIET)
    assert folder_bytes(out) == folder_bytes(clean)


# ---------------------------------------------------------------- bad input

def shard_of(folder: Path, name: str) -> Path:
    return folder / json.loads((folder / INDEX).read_text())["weight_map"][name]


def edit_header(folder: Path, name: str, **fields) -> None:
    path = shard_of(folder, name)
    header, payload = read_shard(path)
    header[name].update(fields)
    write_shard(path, header, payload)


def edit_index(folder: Path, edit) -> None:
    index = json.loads((folder / INDEX).read_text())
    edit(index["weight_map"])
    (folder / INDEX).write_text(json.dumps(index))


def add_tensor(folder: Path, name: str) -> None:
    path = folder / "model-00004-of-00020.safetensors"
    header, payload = read_shard(path)
    header[name] = {"dtype": "BF16", "shape": [4], "data_offsets": [len(payload),
                                                                    len(payload) + 8]}
    write_shard(path, header, payload + bytes(8))
    edit_index(folder, lambda m: m.__setitem__(name, path.name))
    index = json.loads((folder / INDEX).read_text())
    index["metadata"]["total_size"] += 8
    (folder / INDEX).write_text(json.dumps(index))


def drop_from_shard(folder: Path, name: str) -> None:
    """Remove a tensor's header entry (its bytes stay, unreferenced); the index still names it."""
    path = shard_of(folder, name)
    header, payload = read_shard(path)
    del header[name]
    write_shard(path, header, payload)


def remove_tensor(folder: Path, name: str) -> None:
    """Remove a tensor from its shard's header and from the index (total_size follows)."""
    header, _ = read_shard(shard_of(folder, name))
    begin, end = header[name]["data_offsets"]
    drop_from_shard(folder, name)
    index = json.loads((folder / INDEX).read_text())
    del index["weight_map"][name]
    index["metadata"]["total_size"] -= end - begin
    (folder / INDEX).write_text(json.dumps(index))


def patch_byte(folder: Path, name: str, value: int) -> None:
    path = shard_of(folder, name)
    header, payload = read_shard(path)
    begin = header[name]["data_offsets"][0]
    payload = payload[:begin] + bytes([value]) + payload[begin + 1:]
    write_shard(path, header, payload)


BAD_INPUTS = {
    "missing shard": (lambda f: (f / "model-00005-of-00020.safetensors").unlink(),
                      ["model-00005-of-00020.safetensors", "not found"]),
    "truncated shard": (lambda f: os.truncate(f / "model-00005-of-00020.safetensors", 1000),
                        ["model-00005-of-00020.safetensors", "truncated"]),
    "index names an absent tensor": (lambda f: drop_from_shard(f, "layers.1.attn_norm.weight"),
                                     ["layers.1.attn_norm.weight", "absent"]),
    "wrong dtype": (lambda f: edit_header(f, "layers.1.attn.wq_a.weight", dtype="I8"),
                    ["layers.1.attn.wq_a.weight", "I8"]),
    "wrong shape": (lambda f: edit_header(f, "layers.1.attn.wq_a.weight", shape=[128, 64]),
                    ["layers.1.attn.wq_a"]),
    "wrong table shape": (lambda f: edit_header(f, "layers.1.engram.embed.weight",
                                                shape=[231, 64]),
                          ["layers.1.engram.embed.weight", "(231, 64)"]),
    "unknown tensor": (lambda f: add_tensor(f, "layers.1.attn.mystery"),
                       ["unknown tensor", "layers.1.attn.mystery"]),
    "NaN scale byte": (lambda f: patch_byte(f, "layers.9.ffn.experts.3.w2.scale", 255),
                       ["layers.9.ffn.experts.3.w2.scale", "NaN"]),
    "DSpark tensor missing": (lambda f: remove_tensor(f, "mtp.1.ffn_norm.weight"),
                              ["mtp.1.ffn_norm.weight", "dspark.stages.1"]),
    "config does not match the shards": (
        lambda f: (f / "config.json").write_text((f / "config.json").read_text().replace(
            '"moe_intermediate_size": 64', '"moe_intermediate_size": 96')),
        ["expected"]),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_and_leaves_no_output(ckpt, tmp_path, capsys, case):
    damage, words = BAD_INPUTS[case]
    damage(ckpt)
    out = tmp_path / "mlx"
    assert main(["--hf-path", str(ckpt), "--mlx-path", str(out), "--quiet"]) == 1
    captured = capsys.readouterr()
    message = captured.err.strip()
    assert message.count("\n") == 0 and message.startswith("mlx_v41.convert: error:"), message
    for word in words:
        assert word in message, (word, message)
    assert not out.exists()
    with pytest.raises((CheckpointError, mlx_v41.ConfigError)):
        load_model(out)


def test_existing_output_is_left_untouched(tmp_path, capsys):
    out = tmp_path / "mlx"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["--hf-path", str(GOLDEN), "--mlx-path", str(out), "--quiet"]) == 1
    assert "already exists and is not empty" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert not (tmp_path / "mlx.partial").exists()


def fail_after(count: int):
    """A writer that fills the disk after `count` blocks."""
    calls, original = [0], REAL_WRITE

    def write(handle, block):
        calls[0] += 1
        if calls[0] > count:
            raise OSError(errno.ENOSPC, "No space left on device")
        original(handle, block)
    return write


def test_full_disk_then_corrupted_file_then_resume(tmp_path, monkeypatch, capsys,
                                                   golden_logits):
    out, partial = tmp_path / "mlx", tmp_path / "mlx.partial"
    args = ["--hf-path", str(GOLDEN), "--mlx-path", str(out), "--shard-size", "100KB",
            "--quiet"]
    for count in (0, 30):   # nothing finished: nothing kept; some finished: kept to resume
        monkeypatch.setattr(writer, "_write", fail_after(count))
        assert main(args) == 1
        message = capsys.readouterr().err.strip()
        assert message.count("\n") == 0 and "no space left on device" in message, message
        assert not out.exists() and partial.exists() == (count > 0)
    monkeypatch.undo()
    finished = sorted(json.loads((partial / MANIFEST).read_text())["files"])
    victim = partial / finished[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF                      # same size, different hash: must be rewritten
    victim.write_bytes(bytes(data))
    assert main(args) == 0
    assert f"{len(finished) - 1} of" in capsys.readouterr().out
    assert not partial.exists()
    assert mx.array_equal(load_model(out)(mx.array([PROMPT])), golden_logits).item()


@pytest.mark.slow
def test_bad_settings_and_unreachable_hub(tmp_path, capsys):
    for extra, word in ((["--q-bits", "4"], "need -q"),
                        (["-q", "--q-mode", "mxfp4", "--q-bits", "8"], "--q-bits [4]")):
        assert main(["--hf-path", str(GOLDEN), "--mlx-path", str(tmp_path / "m"), *extra]) == 1
        assert word in capsys.readouterr().err
    offline = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")}
    done = cli("-m", "mlx_v41.convert", "--hf-path", "nobody/no-such-model", "--mlx-path",
               str(tmp_path / "m"), env_extra=offline)
    assert done.returncode == 1
    assert done.stderr.strip().count("\n") == 0 and "nobody/no-such-model" in done.stderr
    assert not (tmp_path / "m").exists()


# ---------------------------------------------------------------- memory-mapped Engram tables

TABLE_VOCAB = 1_300_000  # 6 primes above 1.3M -> ~7.8M rows of 264 B = 2.06 GB
PLANTED = [0, 1, 4095, 1_000_003, 7_000_001]  # rows given non-zero bytes


def big_table_checkpoint(folder: Path) -> Path:
    """Tiny model with one Engram layer whose table is >= 2 GB: written small by the factory,
    then the table is replaced by a sparse one (zero rows, a few planted) of the real size."""
    cfg = tiny_text_config(engram_layer_ids=[1], engram_num_embeddings=[0], engram_head_dim=256)
    write_checkpoint(folder, cfg, engram=True)
    config = json.loads((folder / "config.json").read_text())
    text = config["text_config"]
    text["engram_vocab_size"] = TABLE_VOCAB
    (rows,) = text["engram_num_embeddings"] = engram_num_embeddings(text)
    (folder / "config.json").write_text(json.dumps(config))
    path = shard_of(folder, "layers.1.engram.embed.weight")
    header, payload = read_shard(path)
    kept = {k: v for k, v in header.items()
            if k != "__metadata__" and not k.startswith("layers.1.engram.embed.")}
    blob, new = b"", {}
    for name, entry in kept.items():
        begin, end = entry["data_offsets"]
        new[name] = {**entry, "data_offsets": [len(blob), len(blob) + end - begin]}
        blob += payload[begin:end]
    weight_at = len(blob)
    scale_at = weight_at + rows * 256
    new["layers.1.engram.embed.weight"] = {"dtype": "F8_E4M3", "shape": [rows, 256],
                                           "data_offsets": [weight_at, scale_at]}
    new["layers.1.engram.embed.scale"] = {"dtype": "F8_E8M0", "shape": [rows, 8],
                                          "data_offsets": [scale_at, scale_at + rows * 8]}
    text_header = json.dumps(new).encode()
    text_header += b" " * (-len(text_header) % 8)
    start = 8 + len(text_header)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text_header)) + text_header + blob)
        for row in PLANTED:
            f.seek(start + weight_at + row * 256)
            f.write(((np.arange(256) + row) % 120).astype(np.uint8).tobytes())
            f.seek(start + scale_at + row * 8)
            f.write(bytes([120 + row % 7] * 8))
        f.truncate(start + scale_at + rows * 8)  # the rest stays a hole: zero bytes
    index = json.loads((folder / INDEX).read_text())
    index["metadata"]["total_size"] = sum(
        e["data_offsets"][1] - e["data_offsets"][0]
        for p in set(index["weight_map"].values())
        for k, e in read_header(folder / p).items() if k != "__metadata__")
    (folder / INDEX).write_text(json.dumps(index))
    return folder


def read_header(path: Path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


RSS_PROBE = r"""
import json, os, sys
import numpy as np
import mlx.core as mx
import mlx_v41

from pathlib import Path

def rss():
    fields = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssFile", "RssAnon"):
            fields[key] = int(value.split()[0]) * 1024
    for line in open("/proc/self/io"):
        key, _, value = line.partition(":")
        if key == "read_bytes":
            fields[key] = int(value)
    return fields

# Start cold: drop the page cache of every model file (clean pages; no privileges needed).
for path in Path(sys.argv[1]).rglob("*.safetensors"):
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
before = rss()
model = mlx_v41.load_model(sys.argv[1])
loaded = rss()
table = model.model.layers[1].engram.embed
ids = np.random.default_rng(0).integers(0, table.rows, 1000)
table.storage.gather(ids)
looked_up = rss()
planted = [int(r) for r in sys.argv[2:]]
codes, scales = table.storage.gather(np.array(planted))
model(mx.array([[0, 5, 9, 300]]))
print(json.dumps({"before": before, "loaded": loaded, "looked_up": looked_up,
                  "rows": table.rows, "table_bytes": table.nbytes,
                  "codes": codes.tolist(), "scales": scales.tolist()}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc for RSS")
def test_engram_tables_stay_memory_mapped(tmp_path):
    source = big_table_checkpoint(tmp_path / "hf")
    out = convert(source, tmp_path / "mlx", shard_size=10**9, drop_vision=True,
                  drop_dspark=True, **QUIET)
    manifest = json.loads((out / MANIFEST).read_text())
    assert len(manifest["engram"]["tables"]["model.layers.1.engram.embed"]["files"]) == 3
    for folder in (source, out):
        done = cli("-c", RSS_PROBE, str(folder), *map(str, PLANTED))
        assert done.returncode == 0, done.stderr
        r = json.loads(done.stdout.strip().splitlines()[-1])
        assert r["table_bytes"] >= 2 * 10**9
        grown = r["loaded"]["VmRSS"] - r["before"]["VmRSS"]
        assert grown < r["table_bytes"] / 40, (folder, grown)       # < 2.5% of the table
        # 1000 random rows map and read at most two 4 KiB pages each: MADV_RANDOM turns off
        # readahead, which otherwise reads ~1 MB per row (measured: 986 MB for 1000 rows).
        for key in ("RssFile", "read_bytes"):
            grown = r["looked_up"][key] - r["loaded"][key]
            assert grown <= 1000 * 2 * 4096 + (1 << 20), (folder, key, grown)
        for row, codes, scales in zip(PLANTED, r["codes"], r["scales"]):
            assert codes == (((np.arange(256) + row) % 120)).tolist()
            assert scales == [120 + row % 7] * 8
