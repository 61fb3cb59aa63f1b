"""Random checkpoints in the published Hugging Face layout: what `mlx_v41.demo` builds its tiny
checkpoint with (tests and benchmarks add their options in tests/checkpoint_factory.py).

`write_checkpoint(folder, text_config)` writes config.json, model.safetensors.index.json and the
shards with the published names, dtypes, scale layouts and shard grouping (one shard per layer,
as published). Values are random with the statistics of the reference's tiny checkpoints, so
logits come out well-conditioned (std ≈ 2.5). Encoders here are plain numpy, independent of the
model code.
"""

from __future__ import annotations

import copy
import json
import math
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from ..model.config import official_config_path

FP8_MAX = 448.0  # largest finite E4M3FN value
FP4_MAX = 6.0  # largest E2M1 magnitude
BLOCK = 32  # FP8 weights: 32x32 scale blocks; FP4 experts and Engram rows: 1x32 groups
HEADER_ALIGN = 8  # safetensors pads its JSON header with spaces to this many bytes
# Storage dtype rank as in the safetensors library, which writes higher ranks first.
DTYPE_RANK = {"I8": 5, "F8_E4M3": 7, "F8_E8M0": 8, "BF16": 12, "F32": 15}

# The reference's `tiny` checkpoint (tests/data/goldens/tiny): 12 + 3 layers at hidden 128 that
# still hold every layer role (SWA, ratio-2 and ratio-1 Full, Reuse, Reindex, candidate pool,
# Engram at 1 and 5, DSpark), over a 512-token vocabulary.
TINY_OVERRIDES = {
    "candidate_block_size": 4, "candidate_source_layer_id": 7, "candidate_topk_blocks": 8,
    "compress_ratios": [0, 0, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 0, 0, 0],
    "dspark_markov_rank": 32, "dspark_n_routed_experts": 4, "dspark_noise_token_id": 504,
    "dspark_num_experts_per_tok": 2, "dspark_target_layer_ids": [9, 10, 11],
    "engram_compressed_vocab_size": 308, "engram_head_dim": 32, "engram_layer_ids": [1, 5],
    "engram_n_heads": 2, "engram_num_embeddings": [462, 630], "engram_vocab_size": 64,
    "head_dim": 64, "hidden_size": 128, "index_head_dim": 32, "index_n_heads": 8,
    "index_source_layer_ids": [2, 5, 7, 9, 11], "index_topk": 16, "kv_source_layer_ids": [2, 5, 7],
    "moe_intermediate_size": 64, "n_routed_experts": 8, "num_attention_heads": 4,
    "num_experts_per_tok": 2, "num_hidden_layers": 12, "o_groups": 2, "o_lora_rank": 32,
    "q_lora_rank": 64, "qk_rope_head_dim": 16, "sliding_window": 16, "vocab_size": 512,
    # Same values as published, spelled as floats like the reference's config.json.
    "compress_rope_theta": 160000.0, "rope_theta": 10000.0,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16.0,
                     "original_max_position_embeddings": 65536, "rope_type": "yarn"},
}
TINY_VISION = {"hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 2,
               "num_hidden_layers": 1, "rope_theta": 10000.0}


@dataclass
class Tensor:
    """One stored tensor: a safetensors dtype name and its raw numpy storage.

    Storage is float32 for F32, uint16 bit patterns for BF16, uint8 codes for F8_E4M3 /
    F8_E8M0 and int8 bytes (two FP4 codes each, element 2i in the low nibble) for I8.
    """

    dtype: str
    data: np.ndarray


# ---------------------------------------------------------------- configs

def _official_config() -> dict:
    return json.loads(official_config_path().read_text())


def tiny_text_config(**overrides) -> dict:
    """The tiny text_config (12 + 3 layers, hidden 128, Engram at 1 and 5), updated."""
    return {**_official_config()["text_config"], **TINY_OVERRIDES, **overrides}


def engram_num_embeddings(cfg: dict) -> list:
    """Table rows per Engram layer: the sum of its heads' primes."""
    from ..model.engram_hash import engram_primes

    primes = engram_primes(cfg["engram_layer_ids"], cfg["engram_max_ngram_size"],
                           cfg["engram_n_heads"], cfg["engram_vocab_size"])
    return [int(p.sum()) for p in primes]


def root_config(text_config: dict) -> dict:
    """The full config.json: the published root with a tiny vision tower around `text_config`."""
    root = copy.deepcopy(_official_config())
    root["vision_config"].update(TINY_VISION)
    root["text_config"] = text_config
    root["image_token_id"] = text_config["vocab_size"] - 1
    return root


def sized_text_config(cfg: dict, tokenizer: Optional[Path] = None) -> dict:
    """`cfg` with its Engram sizes derived: table rows from the primes and, given a
    tokenizer.json, the compressed vocabulary its token map has."""
    if not cfg["engram_layer_ids"]:
        return cfg
    cfg = {**cfg, "engram_num_embeddings": engram_num_embeddings(cfg)}
    if tokenizer is not None:
        from ..model.engram_hash import build_token_map

        cfg["engram_compressed_vocab_size"] = int(build_token_map(tokenizer).max()) + 1
    return cfg


# ---------------------------------------------------------------- numpy encoders

def _e4m3_grid() -> np.ndarray:
    """Non-negative finite E4M3FN values by code 0..126 (ascending)."""
    codes = np.arange(0x7F)
    exponent, mantissa = codes >> 3, codes & 7
    normal = (1 + mantissa / 8) * 2.0 ** (exponent - 7)
    return np.where(exponent == 0, mantissa / 8 * 2.0**-6, normal)


E4M3_GRID = _e4m3_grid()
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _nearest_code(magnitude: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Code of the nearest grid value (grid ascending, index = code), ties to the even code."""
    hi = np.clip(np.searchsorted(grid, magnitude), 1, len(grid) - 1)
    lo = hi - 1
    d_lo, d_hi = magnitude - grid[lo], grid[hi] - magnitude
    return np.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)


def encode_bf16(x: np.ndarray) -> np.ndarray:
    """float -> bfloat16 bit patterns (uint16), round to nearest even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def encode_e4m3(x: np.ndarray) -> np.ndarray:
    """float (|x| <= 448) -> E4M3FN codes (uint8)."""
    code = _nearest_code(np.minimum(np.abs(x), FP8_MAX), E4M3_GRID)
    return (code | (np.signbit(x) << 7)).astype(np.uint8)


def encode_e2m1(x: np.ndarray) -> np.ndarray:
    """float (|x| <= 6) -> E2M1 codes 0..15 (bit 3 = sign)."""
    code = _nearest_code(np.minimum(np.abs(x), FP4_MAX), E2M1_GRID)
    return (code | (np.signbit(x) << 3)).astype(np.uint8)


def e8m0_exponent(amax: np.ndarray, fmt_max: float) -> np.ndarray:
    """Smallest power-of-two exponent e with amax / 2^e <= fmt_max (exact, via frexp)."""
    mantissa, exponent = np.frexp(np.maximum(amax, 1e-30) / fmt_max)  # m in [0.5, 1)
    return np.clip(np.where(mantissa == 0.5, exponent - 1, exponent), -127, 127)


def quantize_fp8_blocks(w: np.ndarray) -> tuple[Tensor, Tensor]:
    """[N, K] float -> E4M3 weight + [ceil(N/32), ceil(K/32)] E8M0 block scale."""
    n, k = w.shape
    rows, cols = -(-n // BLOCK), -(-k // BLOCK)
    padded = np.zeros((rows * BLOCK, cols * BLOCK))
    padded[:n, :k] = np.abs(w)
    amax = padded.reshape(rows, BLOCK, cols, BLOCK).max(axis=(1, 3))
    e = e8m0_exponent(amax, FP8_MAX)
    scale = np.repeat(np.repeat(2.0 ** e, BLOCK, axis=0), BLOCK, axis=1)[:n, :k]
    return (Tensor("F8_E4M3", encode_e4m3(w / scale)),
            Tensor("F8_E8M0", (e + 127).astype(np.uint8)))


def quantize_row_groups(w: np.ndarray, fmt: str) -> tuple[Tensor, Tensor]:
    """[N, K] float -> per-(row, 32 along K) E8M0 scales [N, K/32] and FP4 (I8) or E4M3 codes."""
    n, k = w.shape
    groups = w.reshape(n, k // BLOCK, BLOCK)
    fmt_max = FP4_MAX if fmt == "fp4" else FP8_MAX
    e = e8m0_exponent(np.abs(groups).max(axis=-1), fmt_max)
    scaled = (groups / 2.0 ** e[..., None]).reshape(n, k)
    scale = Tensor("F8_E8M0", (e + 127).astype(np.uint8))
    if fmt == "fp8":
        return Tensor("F8_E4M3", encode_e4m3(scaled)), scale
    codes = encode_e2m1(scaled)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return Tensor("I8", packed.astype(np.uint8).view(np.int8)), scale


# ---------------------------------------------------------------- tensor catalogue

class _Generator:
    """Per-tensor random values; each name has its own stream, so adding or removing tensors
    (e.g. Engram) leaves every other tensor's values unchanged."""

    def __init__(self, seed: int):
        self.seed = seed
        self.tensors: dict[str, Tensor] = {}

    def _normal(self, name: str, shape, std: float, mean: float = 0.0) -> np.ndarray:
        rng = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
        return mean + std * rng.standard_normal(shape)

    def f32(self, name, shape, std, mean=0.0):
        self.tensors[name] = Tensor("F32", self._normal(name, shape, std, mean).astype(np.float32))

    def bf16(self, name, shape, std, mean=0.0):
        self.tensors[name] = Tensor("BF16", encode_bf16(self._normal(name, shape, std, mean)))

    def norm(self, name, dim):
        self.bf16(name, (dim,), 0.1, mean=1.0)

    def linear(self, name, out_dims, in_dims, gain=1.0):
        self.bf16(name, (out_dims, in_dims), gain / math.sqrt(in_dims))

    def fp8(self, base, out_dims, in_dims, gain=1.0):
        w = self._normal(f"{base}.weight", (out_dims, in_dims), gain / math.sqrt(in_dims))
        self.tensors[f"{base}.weight"], self.tensors[f"{base}.scale"] = quantize_fp8_blocks(w)

    def rows(self, base, out_dims, in_dims, fmt, std):
        w = self._normal(f"{base}.weight", (out_dims, in_dims), std)
        self.tensors[f"{base}.weight"], self.tensors[f"{base}.scale"] = \
            quantize_row_groups(w, fmt)

    def take(self) -> dict[str, Tensor]:
        out, self.tensors = self.tensors, {}
        return out


def _block(g: _Generator, cfg: dict, p: str, layer: int, n_experts: int) -> None:
    """Tensors of one backbone layer or DSpark stage under prefix `p`."""
    d, hd, n = cfg["hidden_size"], cfg["head_dim"], cfg["hc_mult"]
    heads = cfg["num_attention_heads"]
    q_lora, groups, o_lora = cfg["q_lora_rank"], cfg["o_groups"], cfg["o_lora_rank"]
    inter, mix = cfg["moe_intermediate_size"], (2 + n) * n
    g.norm(f"{p}attn_norm.weight", d)
    g.norm(f"{p}ffn_norm.weight", d)
    for side in ("attn", "ffn"):
        g.f32(f"{p}hc_{side}_fn", (mix, n * d), 1 / math.sqrt(n * d))
        g.f32(f"{p}hc_{side}_base", (mix,), 0.8, mean=0.2)
        g.f32(f"{p}hc_{side}_scale", (3,), 0.06, mean=0.6)
    g.f32(f"{p}attn.attn_sink", (heads,), 0.5)
    g.fp8(f"{p}attn.wq_a", q_lora, d)
    g.norm(f"{p}attn.q_norm.weight", q_lora)
    g.fp8(f"{p}attn.wq_b", heads * hd, q_lora, gain=2.0)
    g.fp8(f"{p}attn.wkv", hd, d)
    g.norm(f"{p}attn.kv_norm.weight", hd)
    g.fp8(f"{p}attn.wo_a", groups * o_lora, heads * hd // groups)
    g.fp8(f"{p}attn.wo_b", d, groups * o_lora)
    g.linear(f"{p}ffn.gate.weight", n_experts, d)
    g.f32(f"{p}ffn.gate.bias", (n_experts,), 0.3)
    g.f32(f"{p}ffn.gate.bias_vl", (n_experts,), 0.25)
    for e in range(n_experts):
        g.rows(f"{p}ffn.experts.{e}.w1", inter, d, "fp4", 4 / math.sqrt(d))
        g.rows(f"{p}ffn.experts.{e}.w3", inter, d, "fp4", 4 / math.sqrt(d))
        g.rows(f"{p}ffn.experts.{e}.w2", d, inter, "fp4", 0.25 / math.sqrt(inter))
    g.fp8(f"{p}ffn.shared_experts.w1", inter, d, gain=4.0)
    g.fp8(f"{p}ffn.shared_experts.w3", inter, d, gain=4.0)
    g.fp8(f"{p}ffn.shared_experts.w2", d, inter, gain=0.25)
    if layer < cfg["num_hidden_layers"]:
        _global_attention(g, cfg, p, layer)


def _global_attention(g: _Generator, cfg: dict, p: str, layer: int) -> None:
    """Compressor and indexer tensors, present by layer role: Full layers own a compressor
    (with a gate at ratio 2), index sources an indexer query, Full index sources its keys."""
    d, hd, q_lora = cfg["hidden_size"], cfg["head_dim"], cfg["q_lora_rank"]
    ratio = cfg["compress_ratios"][layer]
    is_kv, is_ix = layer in cfg["kv_source_layer_ids"], layer in cfg["index_source_layer_ids"]
    if is_kv:
        g.linear(f"{p}attn.compressor.wkv.weight", hd, d)
        if ratio == 2:
            g.linear(f"{p}attn.compressor.wgate.weight", hd, d, gain=2.0)
        g.norm(f"{p}attn.compressor.norm.weight", hd)
    if is_ix:
        ih, idim = cfg["index_n_heads"], cfg["index_head_dim"]
        g.fp8(f"{p}attn.indexer.wq_b", ih * idim, q_lora)
        g.linear(f"{p}attn.indexer.weights_proj.weight", ih, d)
        if is_kv:
            g.linear(f"{p}attn.indexer.wk.weight", idim, hd)
            g.norm(f"{p}attn.indexer.k_norm.weight", idim)


def _dspark(g: _Generator, cfg: dict, stage: int) -> None:
    d, n_mtp = cfg["hidden_size"], cfg["num_nextn_predict_layers"]
    p = f"mtp.{stage}."
    _block(g, cfg, p, cfg["num_hidden_layers"] + stage, cfg["dspark_n_routed_experts"])
    if stage == 0:
        g.fp8(f"{p}main_proj", d, d * len(cfg["dspark_target_layer_ids"]))
        g.norm(f"{p}main_norm.weight", d)
    if stage == n_mtp - 1:
        rank, vocab = cfg["dspark_markov_rank"], cfg["vocab_size"]
        g.norm(f"{p}norm.weight", d)
        g.bf16(f"{p}markov_head.embed.weight", (vocab, rank), 1.0)
        g.linear(f"{p}markov_head.head.weight", vocab, rank)
        g.linear(f"{p}confidence_head.proj.weight", 1, d + rank)


def _engram(g: _Generator, cfg: dict, index: int) -> None:
    layer = cfg["engram_layer_ids"][index]
    p, d, n = f"layers.{layer}.engram.", cfg["hidden_size"], cfg["hc_mult"]
    head_dim = cfg["engram_head_dim"]
    columns = (cfg["engram_max_ngram_size"] - 1) * cfg["engram_n_heads"]
    g.rows(f"{p}embed", cfg["engram_num_embeddings"][index], head_dim, "fp8", 1.0)
    g.fp8(f"{p}wkv", d * (n + 1), columns * head_dim)
    g.bf16(f"{p}q_weight", (n, d), 0.2, mean=1.0)
    g.bf16(f"{p}k_weight", (n, d), 0.2, mean=1.0)


def _vision(g: _Generator, vision: dict, d: int) -> None:
    vd, inter = vision["hidden_size"], vision["intermediate_size"]
    patch = 3 * vision["patch_size"] ** 2
    std = 0.02
    g.bf16("vision.patch_embed.proj.weight", (vd, patch), std)
    g.bf16("vision.patch_embed.proj.bias", (vd,), std)
    for i in range(vision["num_hidden_layers"]):
        p = f"vision.blocks.{i}."
        g.norm(f"{p}norm1.weight", vd)
        g.norm(f"{p}norm2.weight", vd)
        for name, out_dims, in_dims, bias in (("attn.wqkv", 3 * vd, vd, True),
                                              ("attn.wo", vd, vd, True),
                                              ("mlp.w1", 2 * inter, vd, False),
                                              ("mlp.w2", vd, inter, False)):
            g.bf16(f"{p}{name}.weight", (out_dims, in_dims), std)
            if bias:
                g.bf16(f"{p}{name}.bias", (out_dims,), std)
    g.norm("vision.norm.weight", vd)
    g.bf16("aligner.w1.weight", (d, vd * vision["downsample_ratio"] ** 2), std)
    g.bf16("aligner.w1.bias", (d,), std)
    g.bf16("aligner.w2.weight", (d, d), std)
    g.bf16("aligner.w2.bias", (d,), std)


def checkpoint_groups(config: dict, seed: int = 0) -> list[dict[str, Tensor]]:
    """Every tensor of a root `config`, grouped as the published shards are.

    Order: vision + aligner; embed + image delimiters; one group per backbone layer; head + norm;
    one per DSpark stage; one per Engram layer (its table, wkv, q/k weights).
    """
    cfg, g = config["text_config"], _Generator(seed)
    d, vocab = cfg["hidden_size"], cfg["vocab_size"]
    _vision(g, config["vision_config"], d)
    groups = [g.take()]
    g.bf16("embed.weight", (vocab, d), 1.0)
    for name in ("image_start", "image_end", "image_newline"):
        g.bf16(name, (d,), 0.02)
    groups.append(g.take())
    for layer in range(cfg["num_hidden_layers"]):
        _block(g, cfg, f"layers.{layer}.", layer, cfg["n_routed_experts"])
        groups.append(g.take())
    g.linear("head.weight", vocab, d, gain=2.5)
    g.norm("norm.weight", d)
    groups.append(g.take())
    for stage in range(cfg["num_nextn_predict_layers"]):
        _dspark(g, cfg, stage)
        groups.append(g.take())
    for index in range(len(cfg["engram_layer_ids"])):
        _engram(g, cfg, index)
        groups.append(g.take())
    return groups


# ---------------------------------------------------------------- files

def write_safetensors(path, tensors: dict[str, Tensor], metadata: Optional[dict] = None) -> int:
    """Write a safetensors file in the safetensors library's order; returns the payload bytes."""
    order = sorted(tensors, key=lambda k: (-DTYPE_RANK.get(tensors[k].dtype, 0), k))
    header, offset = {"__metadata__": metadata or {"format": "pt"}}, 0
    for name in order:
        t = tensors[name]
        header[name] = {"dtype": t.dtype, "shape": list(t.data.shape),
                        "data_offsets": [offset, offset + t.data.nbytes]}
        offset += t.data.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % HEADER_ALIGN)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name in order:
            f.write(np.ascontiguousarray(tensors[name].data).tobytes())
    return offset


def write_shards(folder, shards: list, config: dict) -> Path:
    """Write `shards` (name -> Tensor dicts, in order) as model-XXXXX-of-YYYYY.safetensors,
    the index and config.json into `folder`."""
    folder = Path(folder)
    weight_map, total = {}, 0
    for i, tensors in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += write_safetensors(folder / name, tensors)
        weight_map.update({k: name for k in tensors})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def write_checkpoint(folder, text_config: Optional[dict] = None, *, seed: int = 0) -> Path:
    """Write a random checkpoint in the published Hugging Face layout.

    Args:
        folder: a folder that already holds the checkpoint's tokenizer.json (with Engram on,
            `engram_compressed_vocab_size` comes from its token map); existing files with the
            checkpoint's names are overwritten.
        text_config: the `text_config` section (default: `tiny_text_config()`);
            `engram_num_embeddings` is recomputed from the primes.
        seed: random seed; each tensor's values depend only on (seed, its name).
    Returns:
        The folder.
    """
    folder = Path(folder)
    tokenizer = folder / "tokenizer.json"
    if not tokenizer.is_file():
        raise FileNotFoundError(f"{tokenizer} not found: write the tokenizer first")
    config = root_config(sized_text_config(dict(text_config or tiny_text_config()), tokenizer))
    return write_shards(folder, checkpoint_groups(config, seed), config)
