"""Strict loading of the published layout (spec checkpoint.md §3–4) on damaged copies of the tiny
golden checkpoint: every bad input fails with a one-line CheckpointError / ConfigError naming
the file, tensor or key; the intact copy loads, drops exactly the mtp / vision tensors and keeps
FP8 / FP4 weights packed, byte for byte.

Shards are edited at the byte level with the minimal safetensors reader/writer below, so dtypes
MLX and numpy cannot express (F8_E4M3, F8_E8M0) are handled the same way as the others.
"""

import json
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_v41
from mlx_v41 import CheckpointError, ConfigError, load_model
from mlx_v41.model.layers import QuantLinear
from mlx_v41.checkpoint.loader import load_weights
from mlx_v41.model.model import Model
from mlx_v41.model.moe import SwitchLinear
from conftest import golden_checkpoint
from shard_bytes import read_shard, write_shard

GOLDEN = golden_checkpoint("tiny")
INDEX = "model.safetensors.index.json"
E8M0_NAN = 0xFF  # checkpoint.md §4: must not occur, a load error
DROPPED = re.compile(r"(mtp|vision|aligner)\..*|image_(start|end|newline)")


# ---------------------------------------------------------------- safetensors at the byte level

def weight_map(folder: Path) -> dict:
    return json.loads((folder / INDEX).read_text())["weight_map"]


def shard_of(folder: Path, name: str) -> Path:
    return folder / weight_map(folder)[name]


def edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def edit_header(folder: Path, name: str, **fields) -> None:
    """Change a header entry (dtype / shape / data_offsets) without touching the bytes."""
    path = shard_of(folder, name)
    header, payload = read_shard(path)
    header[name].update(fields)
    write_shard(path, header, payload)


def tensor_bytes(folder: Path, name: str) -> bytes:
    header, payload = read_shard(shard_of(folder, name))
    begin, end = header[name]["data_offsets"]
    return payload[begin:end]


def replace_tensor(folder: Path, name: str, dtype: str, shape, data: bytes) -> None:
    """Rewrite `name`'s shard with a new dtype/shape/payload for it; other tensors keep bytes."""
    path = shard_of(folder, name)
    header, payload = read_shard(path)
    meta = header.pop("__metadata__", None)
    chunks, offset, new = [], 0, {} if meta is None else {"__metadata__": meta}
    for key, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        begin, end = entry["data_offsets"]
        blob = data if key == name else payload[begin:end]
        entry = {"dtype": dtype, "shape": list(shape)} if key == name else dict(entry)
        entry["data_offsets"] = [offset, offset + len(blob)]
        new[key], offset = entry, offset + len(blob)
        chunks.append(blob)
    write_shard(path, new, b"".join(chunks))


def add_tensor(folder: Path, name: str, shard: str, dtype: str, shape, data: bytes) -> None:
    """Append a tensor to a shard and name it in the index."""
    header, payload = read_shard(folder / shard)
    header[name] = {"dtype": dtype, "shape": list(shape),
                    "data_offsets": [len(payload), len(payload) + len(data)]}
    write_shard(folder / shard, header, payload + data)
    edit_json(folder / INDEX, lambda j: j["weight_map"].__setitem__(name, shard))


def remove_from_index(folder: Path, *names: str) -> None:
    edit_json(folder / INDEX, lambda j: [j["weight_map"].pop(n) for n in names])


def patch_byte(folder: Path, name: str, at: int, value: int) -> None:
    path = shard_of(folder, name)
    header, payload = read_shard(path)
    payload = bytearray(payload)
    payload[header[name]["data_offsets"][0] + at] = value
    write_shard(path, header, bytes(payload))


def load_error(folder: Path, error, *names: str, dspark=False) -> str:
    """Load `folder`; it must raise `error` with a one-line message containing every name."""
    with pytest.raises(error) as info:
        load_model(folder, dspark=dspark)
    message = str(info.value)
    assert "\n" not in message, message
    for name in names:
        assert name in message, message
    return message


# ---------------------------------------------------------------- intact checkpoint

def test_intact_copy_loads(ckpt):
    model = load_model(ckpt)
    assert isinstance(model, Model)
    assert model.engram_hasher is not None
    logits = model(mx.array([[0, 5, 9, 300]]))
    assert logits.shape == (1, 4, 512)
    assert bool(mx.all(mx.isfinite(logits)))


def test_drop_list_is_exactly_mtp_and_vision(ckpt):
    args = mlx_v41.ModelArgs.from_file(ckpt / "config.json")
    dropped = load_weights(Model(args), ckpt)
    names = weight_map(ckpt)
    expected = {n for n in names if DROPPED.fullmatch(n)}
    assert len(expected) == 187 and {n.split(".")[0] for n in expected} == {
        "mtp", "vision", "aligner", "image_start", "image_end", "image_newline"}
    assert set(dropped) == expected
    for name, reason in dropped.items():
        assert isinstance(reason, str) and reason
        assert ("DSpark" if name.startswith("mtp.") else "vision") in reason, (name, reason)


def test_fp8_and_fp4_weights_stay_packed(ckpt):
    model = load_model(ckpt)
    modules = dict(model.named_modules())
    quantized = {n: m for n, m in modules.items() if isinstance(m, (QuantLinear, SwitchLinear))}
    assert len(quantized) > 100
    for name, module in quantized.items():
        assert module.weight.dtype == mx.uint32, name
        assert module.scales.dtype == mx.uint8, name
        assert module.mode == ("mxfp4" if isinstance(module, SwitchLinear) else "mxfp8"), name

    layer = model.model.layers[1]
    # FP8 linear: the E4M3 bytes verbatim, the 32x32 block scale repeated over its 32 rows.
    q_a = layer.self_attn.q_a_proj
    raw_w = np.frombuffer(tensor_bytes(ckpt, "layers.1.attn.wq_a.weight"), np.uint8)
    raw_s = np.frombuffer(tensor_bytes(ckpt, "layers.1.attn.wq_a.scale"), np.uint8).reshape(2, 4)
    assert q_a.weight.shape == (64, 128 // 4)
    assert np.array_equal(np.array(q_a.weight.view(mx.uint8)).ravel(), raw_w)
    assert np.array_equal(np.array(q_a.scales), np.repeat(raw_s, 32, axis=0))
    # FP4 experts: the packed I8 bytes of experts 0..7 stacked, scales unchanged.
    gate = layer.mlp.experts.switch_mlp.gate_proj
    raw_w = np.stack([np.frombuffer(tensor_bytes(ckpt, f"layers.1.ffn.experts.{e}.w1.weight"),
                                    np.uint8) for e in range(8)])
    raw_s = np.stack([np.frombuffer(tensor_bytes(ckpt, f"layers.1.ffn.experts.{e}.w1.scale"),
                                    np.uint8) for e in range(8)])
    assert gate.weight.shape == (8, 64, 128 // 8)
    assert np.array_equal(np.array(gate.weight.view(mx.uint8)).reshape(8, -1), raw_w)
    assert np.array_equal(np.array(gate.scales).reshape(8, -1), raw_s)
    # Engram table: FP8 rows and per-32 scales as stored.
    (codes, scales), = layer.engram.embed.storage.parts  # memory-mapped, not parameters
    assert np.array_equal(codes.ravel(), np.frombuffer(
        tensor_bytes(ckpt, "layers.1.engram.embed.weight"), np.uint8))
    assert np.array_equal(scales.ravel(), np.frombuffer(
        tensor_bytes(ckpt, "layers.1.engram.embed.scale"), np.uint8))


# ---------------------------------------------------------------- folder, index, shard files

def test_model_folder_missing(tmp_path):
    load_error(tmp_path / "nowhere", CheckpointError, "nowhere", "not found")


def test_shard_file_missing(ckpt):
    (ckpt / "model-00005-of-00020.safetensors").unlink()
    load_error(ckpt, CheckpointError, "model-00005-of-00020.safetensors", "not found")


def test_index_names_a_shard_that_does_not_exist(ckpt):
    edit_json(ckpt / INDEX, lambda j: j["weight_map"].__setitem__(
        "layers.3.attn_norm.weight", "model-00099-of-00020.safetensors"))
    load_error(ckpt, CheckpointError, "model-00099-of-00020.safetensors")


def test_index_missing(ckpt):
    (ckpt / INDEX).unlink()
    load_error(ckpt, CheckpointError, INDEX)


def test_index_corrupt_json(ckpt):
    (ckpt / INDEX).write_text('{"weight_map": {"embed.weight": ')
    load_error(ckpt, CheckpointError, INDEX)


def test_index_without_weight_map(ckpt):
    (ckpt / INDEX).write_text('{"metadata": {}}')
    load_error(ckpt, CheckpointError, INDEX)


def test_index_weight_map_not_an_object(ckpt):
    (ckpt / INDEX).write_text('{"weight_map": []}')
    load_error(ckpt, CheckpointError, INDEX)


def test_shard_truncated_mid_tensor(ckpt):
    shard = ckpt / "model-00005-of-00020.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    load_error(ckpt, CheckpointError, shard.name, "truncated",
               "layers.2.ffn.experts.7.w3.weight")


def test_shard_truncated_inside_header(ckpt):
    shard = ckpt / "model-00005-of-00020.safetensors"
    shard.write_bytes(shard.read_bytes()[:200])
    load_error(ckpt, CheckpointError, shard.name, "header")


def test_shard_shorter_than_header_length(ckpt):
    shard = ckpt / "model-00005-of-00020.safetensors"
    shard.write_bytes(b"\x10\x00\x00")
    load_error(ckpt, CheckpointError, shard.name, "truncated")


def test_shard_header_corrupt_json(ckpt):
    shard = ckpt / "model-00005-of-00020.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[8] = ord("#")
    shard.write_bytes(bytes(raw))
    load_error(ckpt, CheckpointError, shard.name, "header")


def test_shard_header_entry_without_offsets(ckpt):
    path = shard_of(ckpt, "layers.2.attn_norm.weight")
    header, payload = read_shard(path)
    del header["layers.2.attn_norm.weight"]["data_offsets"]
    write_shard(path, header, payload)
    load_error(ckpt, CheckpointError, path.name, "layers.2.attn_norm.weight")


def test_shard_negative_data_offsets(ckpt):
    edit_header(ckpt, "layers.2.attn_norm.weight", data_offsets=[-256, 0])
    load_error(ckpt, CheckpointError, "layers.2.attn_norm.weight")


# ---------------------------------------------------------------- index vs shards

def test_index_names_tensor_absent_from_its_shard(ckpt):
    path = shard_of(ckpt, "layers.3.attn_norm.weight")
    header, payload = read_shard(path)
    del header["layers.3.attn_norm.weight"]
    write_shard(path, header, payload)
    load_error(ckpt, CheckpointError, path.name, "layers.3.attn_norm.weight", "absent")


def test_index_points_tensor_at_wrong_shard(ckpt):
    edit_json(ckpt / INDEX, lambda j: j["weight_map"].__setitem__(
        "layers.3.attn.wq_a.weight", "model-00004-of-00020.safetensors"))
    load_error(ckpt, CheckpointError, "model-00004-of-00020.safetensors",
               "layers.3.attn.wq_a.weight")


def test_unknown_tensor_name(ckpt):
    add_tensor(ckpt, "layers.1.attn.foo.weight", "model-00004-of-00020.safetensors",
               "BF16", [4], bytes(8))
    load_error(ckpt, CheckpointError, "layers.1.attn.foo.weight", "unknown")


def test_tensor_for_a_role_this_layer_lacks(ckpt):
    # Layer 3 is a Reuse layer: it has no compressor of its own.
    add_tensor(ckpt, "layers.3.attn.compressor.wkv.weight", "model-00006-of-00020.safetensors",
               "BF16", [64, 128], bytes(64 * 128 * 2))
    load_error(ckpt, CheckpointError, "layers.3.attn.compressor.wkv.weight")


def test_tensor_for_a_layer_past_the_config(ckpt):
    add_tensor(ckpt, "layers.12.attn_norm.weight", "model-00004-of-00020.safetensors",
               "BF16", [128], bytes(256))
    load_error(ckpt, CheckpointError, "layers.12.attn_norm.weight")


def test_tensor_missing_from_index(ckpt):
    remove_from_index(ckpt, "layers.4.ffn_norm.weight")
    load_error(ckpt, CheckpointError, "layers.4.ffn_norm.weight for parameter "
               "model.layers.4.post_attention_layernorm.weight")


@pytest.mark.parametrize("name, param", [
    ("mtp.1.ffn_norm.weight", "dspark.stages.1.post_attention_layernorm.weight"),
    ("mtp.0.main_proj.weight", "dspark.main_proj.scales"),
    ("mtp.2.attn.wo_a.weight", "dspark.stages.2.self_attn.o_a_proj.scales"),
    ("mtp.2.markov_head.head.weight", "dspark.markov_head.head"),
])
def test_dspark_tensor_missing_from_index(ckpt, name, param):
    remove_from_index(ckpt, name)
    load_error(ckpt, CheckpointError, f"{name} for parameter {param}", dspark=True)
    # By default the drafter loads when the folder has mtp.*: strictly, with the way out named.
    load_error(ckpt, CheckpointError, f"{name} for parameter {param}",
               "dspark=False loads without the drafter", dspark=None)
    assert "dspark" not in load_model(ckpt, dspark=False)          # mtp.* dropped


def test_dspark_without_mtp_tensors(ckpt):
    remove_from_index(ckpt, *[n for n in weight_map(ckpt) if n.startswith("mtp.")])
    load_error(ckpt, CheckpointError, f"no DSpark tensors (mtp.*) in {ckpt}",
               "load with dspark=False", dspark=True)
    assert "dspark" not in load_model(ckpt)          # by default: loads without the drafter


def test_scale_missing_from_index(ckpt):
    remove_from_index(ckpt, "layers.4.attn.wq_b.scale")
    load_error(ckpt, CheckpointError, "layers.4.attn.wq_b.scale", "missing")


def test_expert_scale_missing_from_index(ckpt):
    remove_from_index(ckpt, "layers.4.ffn.experts.5.w2.scale")
    load_error(ckpt, CheckpointError, "layers.4.ffn.experts.5.w2.scale")


def test_expert_missing_from_index(ckpt):
    remove_from_index(ckpt, "layers.4.ffn.experts.5.w2.weight", "layers.4.ffn.experts.5.w2.scale")
    load_error(ckpt, CheckpointError, "layers.4.ffn.experts.5.w2")


def test_expert_ids_with_a_gap(ckpt):
    for w in ("w1", "w2", "w3"):
        for part in ("weight", "scale"):
            old, new = f"layers.1.ffn.experts.7.{w}.{part}", f"layers.1.ffn.experts.9.{w}.{part}"
            path = shard_of(ckpt, old)
            header, payload = read_shard(path)
            header[new] = header.pop(old)
            write_shard(path, header, payload)
            edit_json(ckpt / INDEX, lambda j: j["weight_map"].__setitem__(
                new, j["weight_map"].pop(old)))
    load_error(ckpt, CheckpointError, "layers.1.ffn.experts.9")


# ---------------------------------------------------------------- dtypes

def test_fp8_weight_rewritten_as_bf16(ckpt):
    codes = np.frombuffer(tensor_bytes(ckpt, "layers.1.attn.wq_a.weight"), np.uint8)
    as_bf16 = (codes.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    replace_tensor(ckpt, "layers.1.attn.wq_a.weight", "BF16", [64, 128], as_bf16.tobytes())
    load_error(ckpt, CheckpointError, "layers.1.attn.wq_a.weight", "BF16", "F8_E4M3")


def test_bf16_norm_rewritten_as_f16(ckpt):
    raw = np.frombuffer(tensor_bytes(ckpt, "layers.1.attn_norm.weight"), np.uint16)
    values = (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float16)
    replace_tensor(ckpt, "layers.1.attn_norm.weight", "F16", [128], values.tobytes())
    load_error(ckpt, CheckpointError, "layers.1.attn_norm.weight", "F16")


@pytest.mark.parametrize("name, dtype", [
    ("layers.1.attn.wq_a.weight", "I8"),           # FP8 weight labelled as packed FP4
    ("layers.1.attn.wq_a.scale", "U8"),            # E8M0 scale labelled as plain bytes
    ("layers.1.ffn.experts.3.w2.weight", "F8_E4M3"),
    ("layers.1.engram.embed.weight", "I8"),
])
def test_wrong_dtype_label(ckpt, name, dtype):
    edit_header(ckpt, name, dtype=dtype)
    load_error(ckpt, CheckpointError, name, dtype)


def test_unsupported_dtype(ckpt):
    edit_header(ckpt, "layers.1.attn_norm.weight", dtype="F4")
    load_error(ckpt, CheckpointError, "layers.1.attn_norm.weight", "F4")


@pytest.mark.parametrize("name,at", [("layers.1.attn.wq_a.scale", 0),
                                     ("layers.1.ffn.experts.0.w1.scale", 0),
                                     ("layers.2.ffn.experts.3.w2.scale", 5),
                                     ("layers.3.attn.wo_b.scale", 1)])
def test_nan_e8m0_scale(ckpt, name, at):
    """Scales are checked together (one evaluation for a load, one for each projection's
    experts); the error still names the tensor that holds the NaN."""
    patch_byte(ckpt, name, at, E8M0_NAN)
    load_error(ckpt, CheckpointError, name)


# ---------------------------------------------------------------- shapes

def test_header_size_disagrees_with_shape(ckpt):
    edit_header(ckpt, "layers.1.attn_norm.weight", shape=[129])
    load_error(ckpt, CheckpointError, "layers.1.attn_norm.weight", "129")


@pytest.mark.parametrize("name, shape", [
    ("layers.2.attn.compressor.wkv.weight", [128, 64]),
    ("layers.1.attn_norm.weight", [2, 64]),
    ("layers.1.engram.embed.weight", [231, 64]),
])
def test_wrong_shape_plain(ckpt, name, shape):
    edit_header(ckpt, name, shape=shape)
    load_error(ckpt, CheckpointError, name.removesuffix(".weight"), str(tuple(shape)))


def test_wrong_shape_fp8_weight_and_scale_together(ckpt):
    edit_header(ckpt, "layers.1.attn.wq_a.weight", shape=[128, 64])
    edit_header(ckpt, "layers.1.attn.wq_a.scale", shape=[4, 2])
    load_error(ckpt, CheckpointError, "layers.1.attn.wq_a", "q_a_proj")


def test_wrong_shape_all_experts(ckpt):
    for e in range(8):
        edit_header(ckpt, f"layers.1.ffn.experts.{e}.w1.weight", shape=[128, 32])
        edit_header(ckpt, f"layers.1.ffn.experts.{e}.w1.scale", shape=[128, 2])
    load_error(ckpt, CheckpointError, "layers.1.ffn.experts", "gate_proj")


@pytest.mark.parametrize("name, shape", [
    ("layers.1.attn.wq_a.weight", [128, 64]),
    ("layers.1.attn.wq_a.scale", [4, 2]),
    ("layers.1.attn.wo_a.weight", [128, 64]),
])
def test_wrong_shape_fp8(ckpt, name, shape):
    edit_header(ckpt, name, shape=shape)
    load_error(ckpt, CheckpointError, name.rsplit(".", 1)[0])


@pytest.mark.parametrize("name, shape", [
    ("layers.1.ffn.experts.2.w1.weight", [128, 32]),
    ("layers.1.ffn.experts.2.w1.scale", [128, 2]),
])
def test_wrong_shape_one_expert(ckpt, name, shape):
    edit_header(ckpt, name, shape=shape)
    load_error(ckpt, CheckpointError, name)


# ---------------------------------------------------------------- config.json and tokenizer

def test_config_missing(ckpt):
    (ckpt / "config.json").unlink()
    load_error(ckpt, ConfigError, "config.json", "not found")


def test_config_corrupt_json(ckpt):
    (ckpt / "config.json").write_text('{"text_config": ')
    load_error(ckpt, ConfigError, "config.json", "JSON")


def test_config_missing_hidden_size(ckpt):
    edit_json(ckpt / "config.json", lambda c: c["text_config"].pop("hidden_size"))
    load_error(ckpt, ConfigError, "text_config.hidden_size")


def test_config_compress_ratios_too_short(ckpt):
    edit_json(ckpt / "config.json", lambda c: c["text_config"]["compress_ratios"].pop())
    load_error(ckpt, ConfigError, "compress_ratios", "15")


def test_config_kv_source_on_ratio_0_layer(ckpt):
    edit_json(ckpt / "config.json",
              lambda c: c["text_config"].__setitem__("kv_source_layer_ids", [1, 2, 5, 7]))
    load_error(ckpt, ConfigError, "kv_source_layer_ids", "layer 1")


def test_config_rope_scaling_without_factor(ckpt):
    edit_json(ckpt / "config.json", lambda c: c["text_config"]["rope_scaling"].pop("factor"))
    load_error(ckpt, ConfigError, "rope_scaling", "factor")


def test_no_engram_token_map(ckpt):
    (ckpt / "tokenizer.json").unlink()
    (ckpt / "engram_token_map.json").unlink()
    load_error(ckpt, CheckpointError, "tokenizer.json")


def test_tokenizer_corrupt_json(ckpt):
    (ckpt / "tokenizer.json").write_text("{")
    load_error(ckpt, CheckpointError, "tokenizer.json")


def test_tokenizer_disagrees_with_compressed_vocab_size(ckpt):
    edit_json(ckpt / "config.json",
              lambda c: c["text_config"].__setitem__("engram_compressed_vocab_size", 307))
    with pytest.raises((CheckpointError, ConfigError)) as info:
        load_model(ckpt)
    assert "engram_compressed_vocab_size" in str(info.value)


def test_a_one_stage_drafter_loads_its_heads_from_that_stage(tmp_path):
    """The drafter's heads (norm, Markov, confidence) sit on its last stage: `mtp.2.` in the
    published 3-stage layout, `mtp.0.` with one stage (bench_real_width's checkpoint), which
    was refused as an unknown tensor."""
    from checkpoint_factory import write_checkpoint

    from mlx_v41.checkpoint.random_checkpoint import tiny_text_config

    cfg = tiny_text_config(
        num_hidden_layers=4, compress_ratios=[0, 2, 1, 0, 0], kv_source_layer_ids=[1, 2],
        index_source_layer_ids=[1, 2], candidate_source_layer_id=2, num_nextn_predict_layers=1,
        dspark_target_layer_ids=[1, 2, 3], hidden_size=64, n_routed_experts=4,
        dspark_n_routed_experts=2, moe_intermediate_size=32)
    folder = write_checkpoint(tmp_path / "hf", cfg, engram=False)
    model = mlx_v41.load_model(folder, dspark=True)
    tensors = {}
    for shard in folder.glob("*.safetensors"):
        tensors.update(mx.load(str(shard)))
    want = tensors["mtp.0.confidence_head.proj.weight"].astype(mx.float32)
    got = model.dspark.confidence_head.proj.astype(mx.float32)
    assert got.shape == want.shape and mx.array_equal(got, want).item()
    assert not any(name.startswith("mtp.2.") for name in tensors)
