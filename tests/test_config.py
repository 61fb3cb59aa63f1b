"""config.py and layer_roles.py against the spec (config.md §1, §3–5), transcribed by hand.

The 43-row schedule below is spec config.md §3 copied verbatim; the tiny golden's schedule is
config.md §4's rules applied by hand. Neither is derived from the code under test.
"""

import json
import warnings
from pathlib import Path

import pytest

from mlx_v41 import ConfigError, ModelArgs
from mlx_v41.model.config import TextConfig, official_config_path
from mlx_v41.model.schedule import decoder_start, layer_roles

TINY_CONFIG = Path(__file__).parent / "data" / "goldens" / "tiny" / "hf" / "config.json"
SCHEDULE_CONFIG = TINY_CONFIG.parents[2] / "schedule" / "hf" / "config.json"

# config.md §3, verbatim: L | CED role | ratio | mode | KV from | top-k from | compressor |
# indexer | candidate pool | RoPE | MoE (experts/top-k) | extra
OFFICIAL_SCHEDULE = """
| 0 | encoder | 0 | SWA | – | – | – | – | – | 10000 | 384/6 |  |
| 1 | encoder | 0 | SWA | – | – | – | – | – | 10000 | 384/6 | Engram before block |
| 2 | encoder | 2 | **Full** | 2 | 2 | m=2 (wkv+wgate) | own q + own K | – | 160000+YaRN | 384/6 |  |
| 3 | encoder | 2 | Reuse | 2 | 2 | – | – | – | 160000+YaRN | 384/6 |  |
| 4 | encoder | 2 | Reuse | 2 | 2 | – | – | – | 160000+YaRN | 384/6 |  |
| 5 | encoder | 2 | Reuse | 2 | 2 | – | – | – | 160000+YaRN | 384/6 |  |
| 6 | encoder | 2 | Reuse | 2 | 2 | – | – | – | 160000+YaRN | 384/6 |  |
| 7 | encoder | 2 | Reuse | 2 | 2 | – | – | – | 160000+YaRN | 384/6 |  |
| 8 | encoder | 2 | **Full** | 8 | 8 | m=2 (wkv+wgate) | own q + own K | – | 160000+YaRN | 384/6 |  |
| 9 | encoder | 2 | Reuse | 8 | 8 | – | – | – | 160000+YaRN | 384/6 |  |
| 10 | encoder | 2 | Reuse | 8 | 8 | – | – | – | 160000+YaRN | 384/6 |  |
| 11 | encoder | 2 | Reuse | 8 | 8 | – | – | – | 160000+YaRN | 384/6 |  |
| 12 | encoder | 2 | Reuse | 8 | 8 | – | – | – | 160000+YaRN | 384/6 |  |
| 13 | encoder | 2 | Reuse | 8 | 8 | – | – | – | 160000+YaRN | 384/6 |  |
| 14 | encoder | 2 | **Full** | 14 | 14 | m=2 (wkv+wgate) | own q + own K | – | 160000+YaRN | 384/6 | Engram before block |
| 15 | encoder | 2 | Reuse | 14 | 14 | – | – | – | 160000+YaRN | 384/6 |  |
| 16 | encoder | 2 | Reuse | 14 | 14 | – | – | – | 160000+YaRN | 384/6 |  |
| 17 | encoder | 2 | Reuse | 14 | 14 | – | – | – | 160000+YaRN | 384/6 |  |
| 18 | encoder | 2 | Reuse | 14 | 14 | – | – | – | 160000+YaRN | 384/6 |  |
| 19 | encoder | 2 | Reuse | 14 | 14 | – | – | – | 160000+YaRN | 384/6 |  |
| 20 | decoder | 1 | **Full** | 20 | 20 | m=1 (wkv only) | own q + own K | **source** | 160000+YaRN | 384/6 | CED: decoder global KV |
| 21 | decoder | 1 | Reuse | 20 | 20 | – | – | – | 160000+YaRN | 384/6 |  |
| 22 | decoder | 1 | Reuse | 20 | 20 | – | – | – | 160000+YaRN | 384/6 |  |
| 23 | decoder | 1 | Reuse | 20 | 20 | – | – | – | 160000+YaRN | 384/6 |  |
| 24 | decoder | 1 | **Reindex** | 20 | 24 | – | own q, K of 20 | restricted | 160000+YaRN | 384/6 |  |
| 25 | decoder | 1 | Reuse | 20 | 24 | – | – | – | 160000+YaRN | 384/6 |  |
| 26 | decoder | 1 | Reuse | 20 | 24 | – | – | – | 160000+YaRN | 384/6 |  |
| 27 | decoder | 1 | Reuse | 20 | 24 | – | – | – | 160000+YaRN | 384/6 |  |
| 28 | decoder | 1 | **Reindex** | 20 | 28 | – | own q, K of 20 | restricted | 160000+YaRN | 384/6 |  |
| 29 | decoder | 1 | Reuse | 20 | 28 | – | – | – | 160000+YaRN | 384/6 |  |
| 30 | decoder | 1 | Reuse | 20 | 28 | – | – | – | 160000+YaRN | 384/6 |  |
| 31 | decoder | 1 | Reuse | 20 | 28 | – | – | – | 160000+YaRN | 384/6 |  |
| 32 | decoder | 1 | **Reindex** | 20 | 32 | – | own q, K of 20 | restricted | 160000+YaRN | 384/6 |  |
| 33 | decoder | 1 | Reuse | 20 | 32 | – | – | – | 160000+YaRN | 384/6 |  |
| 34 | decoder | 1 | Reuse | 20 | 32 | – | – | – | 160000+YaRN | 384/6 |  |
| 35 | decoder | 1 | Reuse | 20 | 32 | – | – | – | 160000+YaRN | 384/6 |  |
| 36 | decoder | 1 | **Reindex** | 20 | 36 | – | own q, K of 20 | restricted | 160000+YaRN | 384/6 |  |
| 37 | decoder | 1 | Reuse | 20 | 36 | – | – | – | 160000+YaRN | 384/6 | DSpark tap (input) |
| 38 | decoder | 1 | Reuse | 20 | 36 | – | – | – | 160000+YaRN | 384/6 | DSpark tap (input) |
| 39 | decoder | 1 | Reuse | 20 | 36 | – | – | – | 160000+YaRN | 384/6 | DSpark tap (input) |
| 40 | DSpark | 0 | SWA | – | – | – | – | – | 10000 | 128/3 | draft stage mtp.0 |
| 41 | DSpark | 0 | SWA | – | – | – | – | – | 10000 | 128/3 | draft stage mtp.1 |
| 42 | DSpark | 0 | SWA | – | – | – | – | – | 10000 | 128/3 | draft stage mtp.2 |
"""  # noqa: E501 (the spec table verbatim)

# config.md §4 rules applied by hand to the tiny golden: N = 12, ratios [0,0,2×5,1×5,0,0,0],
# KV [2,5,7], IX [2,5,7,9,11], C = 7, Engram [1,5], taps [9,10,11], 8/2 experts, DSpark 4/2.
# CED split: the decoder starts at the first ratio-1 kv source (layer_roles.decoder_start), 7
# here; config.md §4's N/2 rule would make layer 6 a decoder layer (same split, 20, for N = 40).
TINY_SCHEDULE = """
| 0 | encoder | 0 | SWA | – | – | – | – | – | 10000 | 8/2 |  |
| 1 | encoder | 0 | SWA | – | – | – | – | – | 10000 | 8/2 | Engram before block |
| 2 | encoder | 2 | **Full** | 2 | 2 | m=2 (wkv+wgate) | own q + own K | – | 160000+YaRN | 8/2 |  |
| 3 | encoder | 2 | Reuse | 2 | 2 | – | – | – | 160000+YaRN | 8/2 |  |
| 4 | encoder | 2 | Reuse | 2 | 2 | – | – | – | 160000+YaRN | 8/2 |  |
| 5 | encoder | 2 | **Full** | 5 | 5 | m=2 (wkv+wgate) | own q + own K | – | 160000+YaRN | 8/2 | Engram before block |
| 6 | encoder | 2 | Reuse | 5 | 5 | – | – | – | 160000+YaRN | 8/2 |  |
| 7 | decoder | 1 | **Full** | 7 | 7 | m=1 (wkv only) | own q + own K | **source** | 160000+YaRN | 8/2 |  |
| 8 | decoder | 1 | Reuse | 7 | 7 | – | – | – | 160000+YaRN | 8/2 |  |
| 9 | decoder | 1 | **Reindex** | 7 | 9 | – | own q, K of 7 | restricted | 160000+YaRN | 8/2 | DSpark tap (input) |
| 10 | decoder | 1 | Reuse | 7 | 9 | – | – | – | 160000+YaRN | 8/2 | DSpark tap (input) |
| 11 | decoder | 1 | **Reindex** | 7 | 11 | – | own q, K of 7 | restricted | 160000+YaRN | 8/2 | DSpark tap (input) |
| 12 | DSpark | 0 | SWA | – | – | – | – | – | 10000 | 4/2 | draft stage mtp.0 |
| 13 | DSpark | 0 | SWA | – | – | – | – | – | 10000 | 4/2 | draft stage mtp.1 |
| 14 | DSpark | 0 | SWA | – | – | – | – | – | 10000 | 4/2 | draft stage mtp.2 |
"""  # noqa: E501 (the spec table verbatim)

NONE = "–"
MODES = {"SWA": "swa", "Full": "full", "Reindex": "reindex", "Reuse": "reuse"}
CED_ROLES = {"encoder": "encoder", "decoder": "decoder", "DSpark": "draft"}


def parse_schedule(table: str) -> list[dict]:
    """Spec-table rows -> the LayerRole attributes each row states."""
    rows = []
    for line in table.strip().splitlines():
        cells = [c.strip().strip("*") for c in line.strip().strip("|").split("|")]
        layer, ced, ratio, mode, kv, topk, compressor, indexer, cand, rope, moe, extra = cells
        experts, top_k = moe.split("/")
        rows.append(dict(
            layer=int(layer), ced_role=CED_ROLES[ced], ratio=int(ratio), mode=MODES[mode],
            kv_owner=None if kv == NONE else int(kv),
            topk_owner=None if topk == NONE else int(topk),
            has_compressor=compressor != NONE, has_gate_proj=compressor.startswith("m=2"),
            has_indexer=indexer != NONE, owns_index_k=indexer == "own q + own K",
            is_candidate_source=cand == "source", uses_candidates=cand == "restricted",
            uses_yarn=rope == "160000+YaRN", has_global=int(ratio) > 0,
            has_engram="Engram before block" in extra, is_dspark_tap="DSpark tap" in extra,
            is_dspark=extra.startswith("draft stage"),
            n_experts=int(experts), experts_per_tok=int(top_k)))
        if indexer.startswith("own q, K of "):  # a Reindex layer scores its KV owner's keys
            assert rows[-1]["kv_owner"] == int(indexer.rsplit(" ", 1)[1])
    return rows


def actual_schedule(cfg: TextConfig) -> list[dict]:
    roles = layer_roles(cfg)
    keys = parse_schedule(TINY_SCHEDULE)[0].keys() - {"has_engram"}
    derived = {"has_gate_proj", "uses_yarn", "has_global"}  # what the ratio implies
    return [dict({k: getattr(r, k) for k in keys - derived}, has_engram=r.engram_index is not None,
                 has_gate_proj=r.has_compressor and r.ratio > 1, uses_yarn=r.ratio > 0,
                 has_global=r.ratio > 0)
            for r in roles]


def official_dict() -> dict:
    return json.loads(official_config_path().read_text())


def from_official(edit) -> ModelArgs:
    data = official_dict()
    edit(data)
    return ModelArgs.from_dict(data)


def config_error(edit, *names: str) -> str:
    """`edit` of the official config must fail with a one-line ConfigError naming `names`."""
    with pytest.raises(ConfigError) as info:
        from_official(edit)
    message = str(info.value)
    assert "\n" not in message, message
    for name in names:
        assert name in message, message
    return message


def set_text(key, value):
    return lambda d: d["text_config"].__setitem__(key, value)


# ---------------------------------------------------------------- the published config

def test_official_config_equals_defaults():
    assert official_config_path().is_file()
    assert ModelArgs.from_file(official_config_path()) == ModelArgs()


def test_official_config_keys_all_become_fields():
    """Nothing in the published file is silently ignored, and the defaults add nothing."""
    as_dict = ModelArgs().to_dict()
    assert as_dict.pop("quantization") is None  # written by mlx_v41.convert only
    assert as_dict == official_dict()


@pytest.mark.parametrize("path, value", [
    ("model_type", "deepseek_v41"),
    ("bos_token_id", 0),
    ("eos_token_id", 1),
    ("image_token_id", 129264),
    ("quantization_config.weight_block_size", [32, 32]),
    ("quantization_config.expert_dtype", "fp4"),
    ("quantization_config.scale_fmt", "ue8m0"),
    ("text_config.vocab_size", 129280),
    ("text_config.hidden_size", 5120),
    ("text_config.num_hidden_layers", 40),
    ("text_config.num_nextn_predict_layers", 3),
    ("text_config.num_attention_heads", 64),
    ("text_config.head_dim", 512),
    ("text_config.qk_rope_head_dim", 64),
    ("text_config.q_lora_rank", 1280),
    ("text_config.o_lora_rank", 1024),
    ("text_config.o_groups", 8),
    ("text_config.moe_intermediate_size", 2304),
    ("text_config.n_routed_experts", 384),
    ("text_config.num_experts_per_tok", 6),
    ("text_config.routed_scaling_factor", 1.5),
    ("text_config.swiglu_limit", 10.0),
    ("text_config.rms_norm_eps", 1e-20),
    ("text_config.rope_theta", 10000),
    ("text_config.compress_rope_theta", 160000),
    ("text_config.rope_scaling.factor", 16),
    ("text_config.rope_scaling.original_max_position_embeddings", 65536),
    ("text_config.sliding_window", 128),
    ("text_config.compress_ratios", [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0]),
    ("text_config.kv_source_layer_ids", [2, 8, 14, 20]),
    ("text_config.index_source_layer_ids", [2, 8, 14, 20, 24, 28, 32, 36]),
    ("text_config.candidate_source_layer_id", 20),
    ("text_config.candidate_topk_blocks", 2048),
    ("text_config.candidate_block_size", 8),
    ("text_config.index_n_heads", 32),
    ("text_config.index_head_dim", 128),
    ("text_config.index_topk", 512),
    ("text_config.hc_mult", 4),
    ("text_config.hc_sinkhorn_iters", 20),
    ("text_config.engram_layer_ids", [1, 14]),
    ("text_config.engram_num_embeddings", [384006168, 384016682]),
    ("text_config.engram_pad_token_id", 2),
    ("text_config.engram_compressed_vocab_size", 99092),
    ("text_config.dspark_noise_token_id", 128799),
    ("text_config.dspark_target_layer_ids", [37, 38, 39]),
    ("text_config.dspark_n_routed_experts", 128),
    ("text_config.dspark_num_experts_per_tok", 3),
    ("vision_config.num_hidden_layers", 32),
    ("vision_config.min_pixels", 295936),
    ("vision_config.max_wh_ratio", None),
])
def test_published_value(path, value):
    node = ModelArgs.from_file(official_config_path())
    for part in path.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    assert node == value


def test_tiny_golden_config_loads():
    args = ModelArgs.from_file(TINY_CONFIG)
    assert args.text_config.num_hidden_layers == 12
    assert args.text_config.compress_ratios == [0, 0, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 0, 0, 0]


def test_unknown_and_optional_keys():
    """The real file carries `transformers_version` (no warning); descriptive text keys may be
    left out."""
    def edit(d):
        d["transformers_version"] = "4.57.0"
        for key in ("attention_bias", "use_cache", "hidden_act", "initializer_range"):
            del d["text_config"][key]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert from_official(edit) == ModelArgs()


def test_unknown_keys_warn_once_naming_them():
    """A misspelled optional key would silently give the default: one warning lists them all."""
    def edit(d):
        d["text_config"]["sliding_windw"] = 64
        d["vision_config"]["patch_sise"] = 16
        d["bos_token"] = 0
    with pytest.warns(UserWarning) as record:
        args = from_official(edit)
    assert args == ModelArgs() and len(record) == 1
    message = str(record[0].message)
    assert "\n" not in message and "config.json" in message
    for key in ("text_config.sliding_windw", "vision_config.patch_sise", "bos_token"):
        assert key in message, message


@pytest.mark.parametrize("path", [official_config_path(), TINY_CONFIG, SCHEDULE_CONFIG],
                         ids=["published", "tiny", "schedule"])
def test_published_and_golden_configs_do_not_warn(path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ModelArgs.from_file(path)


# ---------------------------------------------------------------- missing and inconsistent keys

@pytest.mark.parametrize("key", [
    "hidden_size", "num_hidden_layers", "compress_ratios", "kv_source_layer_ids",
    "index_source_layer_ids", "candidate_source_layer_id", "rope_scaling", "engram_layer_ids",
    "engram_pad_token_id", "dspark_num_experts_per_tok",
])
def test_missing_text_key(key):
    config_error(lambda d: d["text_config"].pop(key), f"text_config.{key}", "missing")


def test_missing_text_config():
    config_error(lambda d: d.pop("text_config"), "text_config")


@pytest.mark.parametrize("key, value, names", [
    ("compress_ratios", [0, 0] + [2] * 18 + [1] * 20 + [0, 0], ("compress_ratios", "43")),
    ("compress_ratios", [0, 0] + [2] * 18 + [1] * 19 + [3] + [0] * 3, ("compress_ratios",)),
    ("compress_ratios", [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 1], ("compress_ratios", "DSpark")),
    ("kv_source_layer_ids", [0, 2, 8, 14, 20], ("kv_source_layer_ids", "layer 0")),
    ("kv_source_layer_ids", [1, 8, 14, 20], ("kv_source_layer_ids", "layer 1")),
    ("kv_source_layer_ids", [2, 8, 14, 20, 40], ("kv_source_layer_ids", "layer 40")),
    ("kv_source_layer_ids", [2, 8, 14], ("kv_source_layer_ids", "layer 20")),
    ("index_source_layer_ids", [2, 14, 20, 24, 28, 32, 36], ("index_source_layer_ids", "8")),
    ("candidate_source_layer_id", 14, ("candidate_source_layer_id",)),
    ("candidate_source_layer_id", 24, ("candidate_source_layer_id",)),
    ("engram_layer_ids", [1, 40], ("engram_layer_ids",)),
    ("engram_num_embeddings", [384006168], ("engram_num_embeddings",)),
    ("dspark_target_layer_ids", [37, 38, 40], ("dspark_target_layer_ids",)),
    ("n_shared_experts", 2, ("n_shared_experts",)),
    ("num_experts_per_tok", 385, ("num_experts_per_tok",)),
    ("o_groups", 7, ("o_groups",)),
    ("hidden_size", 5000, ("hidden_size",)),
    ("qk_rope_head_dim", 63, ("qk_rope_head_dim",)),
    ("scoring_func", "softmax", ("scoring_func",)),
])
def test_inconsistent_text_key(key, value, names):
    config_error(set_text(key, value), *names)


def test_wrong_model_type():
    config_error(lambda d: d.__setitem__("model_type", "deepseek_v3"), "model_type")


def test_unsupported_weight_block_size():
    config_error(lambda d: d["quantization_config"].__setitem__("weight_block_size", [128, 128]),
                 "weight_block_size")


def test_candidate_source_disabled():
    args = from_official(set_text("candidate_source_layer_id", -1))
    assert not any(r.is_candidate_source or r.uses_candidates
                   for r in layer_roles(args.text_config))


def test_candidate_users_must_read_the_candidate_source_kv():
    # Layer 28 becomes a ratio-1 kv source; layers 28, 32, 36 then select candidates from
    # layer 20's pool over layer 28's KV.
    message = config_error(set_text("kv_source_layer_ids", [2, 8, 14, 20, 28]))
    assert "candidate_source_layer_id" in message or "kv_source_layer_ids" in message


@pytest.mark.parametrize("key, value", [
    ("hidden_size", "5120"),
    ("hidden_size", 5120.0),
    ("num_hidden_layers", "40"),
    ("compress_ratios", None),
    ("kv_source_layer_ids", None),
])
def test_wrong_type_names_the_key(key, value):
    config_error(set_text(key, value), f"text_config.{key}")


@pytest.mark.parametrize("key", ["hidden_size", "num_attention_heads", "o_groups"])
def test_zero_size(key):
    config_error(set_text(key, 0), f"text_config.{key}")


def test_rope_scaling_without_factor():
    config_error(lambda d: d["text_config"]["rope_scaling"].pop("factor"), "rope_scaling")


@pytest.mark.parametrize("section, value", [("text_config", None), ("vision_config", [1])])
def test_section_not_an_object(section, value):
    config_error(lambda d: d.__setitem__(section, value), section)


# ---------------------------------------------------------------- layer roles

def test_official_schedule_matches_spec_table():
    expected = parse_schedule(OFFICIAL_SCHEDULE)
    assert len(expected) == 43
    actual = actual_schedule(ModelArgs().text_config)
    for want, got in zip(expected, actual, strict=True):
        assert got == want, f"layer {want['layer']}"


def test_tiny_schedule_matches_rules():
    expected = parse_schedule(TINY_SCHEDULE)
    actual = actual_schedule(ModelArgs.from_file(TINY_CONFIG).text_config)
    for want, got in zip(expected, actual, strict=True):
        assert got == want, f"layer {want['layer']}"


def test_official_schedule_summary():
    """Tech report §4.2.1: 2 SWA, 3 Full m=2, 1 Full m=1, 4 Reindex, 30 Reuse, 3 draft."""
    roles = layer_roles(ModelArgs().text_config)
    modes = [(r.mode, r.ratio) for r in roles[:40]]
    assert modes.count(("swa", 0)) == 2
    assert modes.count(("full", 2)) == 3 and modes.count(("full", 1)) == 1
    assert modes.count(("reindex", 1)) == 4
    assert modes.count(("reuse", 2)) == 15 and modes.count(("reuse", 1)) == 15
    assert [r.layer for r in roles if r.is_dspark] == [40, 41, 42]


def test_engram_indices_follow_engram_layer_ids():
    for cfg, layers in ((ModelArgs().text_config, [1, 14]),
                        (ModelArgs.from_file(TINY_CONFIG).text_config, [1, 5])):
        roles = layer_roles(cfg)
        assert [(r.layer, r.engram_index) for r in roles if r.engram_index is not None] == [
            (layers[0], 0), (layers[1], 1)]


def test_decoder_start():
    assert decoder_start(ModelArgs().text_config) == 20
    assert decoder_start(ModelArgs.from_file(TINY_CONFIG).text_config) == 7
