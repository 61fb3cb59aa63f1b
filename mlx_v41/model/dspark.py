"""DSpark, V4.1's in-checkpoint drafter (official inference/model.py L1032–1155; checkpoint
`mtp.0/1/2`): three window-only stages over a 5-token block (the anchor and four noise tokens),
fed by the target's taps through `main_proj`/`main_norm`, then a rank-256 Markov head that chains
the drafts and a confidence head. Each stage keeps a ring of the last `sliding_window` KV rows,
computed from `main_x` of committed target positions only (drafts never enter it).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from ..cache.stacked import row_shape, share, stacked as stacked_rows
from ..kernels.sparse_attention import attend
from ..kernels.swa_ring import swa_ring_update
from .attention import add_projections
from .config import TextConfig
from .layers import QuantLinear, RMSNorm, head_logits, round_act_fp8
from ..numerics.mhc import collapse, expand
from .mhc import HyperConnection
from .moe import MoE
from .stacked import split_rows
from ..numerics.rope import shared_rope

MAIN_NORM_EPS = 1e-20  # main_norm's eps in the reference, not the text model's


class DSparkAttention(nn.Module):
    """A stage's attention: every block query sees the same keys, the stage's ring rows and all
    block rows (no causal mask inside the block); sinks, inverse RoPE, grouped output."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        add_projections(self, cfg)
        self.rope = shared_rope(cfg.qk_rope_head_dim, cfg.rope_theta)  # base 10000, no YaRN
        self.heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim

    def kv_rows(self, x: mx.array, position) -> mx.array:
        """FP8-rounded, RoPE'd KV rows [B, S, d] of inputs x [B, S, D] at `position`.."""
        return round_act_fp8(self.rope(self.kv_norm(self.kv_proj(x)), position))

    def __call__(self, u: mx.array, ring: Optional[mx.array], position: int) -> mx.array:
        """u [B, n, D] the block's attention input at positions position..; ring [B, r, d]."""
        batch, n, _ = u.shape
        xq = self.kv_proj.prepare(u)
        kv = round_act_fp8(self.rope(self.kv_norm(self.kv_proj.apply(xq)), position))
        keys = kv if ring is None else mx.concatenate([ring.astype(kv.dtype), kv], axis=1)
        q = self.q_b_proj(self.q_a_norm(self.q_a_proj.apply(xq)))
        q = self.rope(q.reshape(batch, n, self.heads, self.head_dim), position)
        keys = mx.broadcast_to(keys[:, None], (batch, n) + keys.shape[1:])
        valid = mx.ones(keys.shape[:3], dtype=mx.bool_)
        out = attend(q, keys, valid, self.sinks, self.head_dim ** -0.5)
        out = self.rope(out, position, inverse=True)
        groups = self.o_a_proj.weight.shape[0]
        out = self.o_a_proj(out.reshape(batch, n, groups, -1))
        return self.o_b_proj(out.reshape(batch, n, -1))


class DSparkStage(nn.Module):
    """The backbone block with DSpark's attention and its own experts (text routing bias only)."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = DSparkAttention(cfg)
        self.mlp = MoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.dspark_n_routed_experts,
                       cfg.dspark_num_experts_per_tok, cfg.routed_scaling_factor,
                       cfg.swiglu_limit)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        hc = (cfg.hc_mult, cfg.hidden_size, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps)
        self.attn_hc = HyperConnection(*hc)
        self.ffn_hc = HyperConnection(*hc)

    def __call__(self, streams, pre_in, ring: Optional[mx.array], position: int):
        """streams [B, n, hc, D] and the previous stage's FFN-side `pre` -> (streams, pre)."""
        u = self.input_layernorm(collapse(streams, pre_in))
        a_pre, a_post, a_comb = self.attn_hc(streams)
        streams = expand(self.self_attn(u, ring, position), streams, a_post, a_comb)
        f_pre, f_post, f_comb = self.ffn_hc(streams)
        u = self.mlp(self.post_attention_layernorm(collapse(streams, a_pre)))
        return expand(u, streams, f_post, f_comb), f_pre


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.embed = mx.zeros((vocab, rank), dtype=mx.bfloat16)
        self.head = mx.zeros((vocab, rank), dtype=mx.bfloat16)


class ConfidenceHead(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = mx.zeros((1, width), dtype=mx.bfloat16)


class DSpark(nn.Module):
    """The drafter's parameters and its block pass (the target's embedding and head are shared,
    passed in, never copied)."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        taps = len(cfg.dspark_target_layer_ids)
        self.main_proj = QuantLinear(cfg.hidden_size * taps, cfg.hidden_size)
        self.main_norm = RMSNorm(cfg.hidden_size, MAIN_NORM_EPS)
        self.stages = [DSparkStage(cfg) for _ in range(cfg.num_nextn_predict_layers)]
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.markov_head = MarkovHead(cfg.vocab_size, cfg.dspark_markov_rank)
        self.confidence_head = ConfidenceHead(cfg.hidden_size + cfg.dspark_markov_rank)
        self.cfg = cfg

    def main_x(self, taps: list) -> mx.array:
        """`main_norm(main_proj(concat(taps)))` [B, S, D]: taps are the target's [B, S, D]
        means over the copies entering `dspark_target_layer_ids`."""
        return self.main_norm(self.main_proj(mx.concatenate(taps, axis=-1)))

    def ring_rows(self, main_x: mx.array, position) -> list:
        """Each stage's ring rows [B, S, d] for committed positions position.. of main_x."""
        return [stage.self_attn.kv_rows(main_x, position) for stage in self.stages]

    def write_rings(self, rings: list, main_x: mx.array, position: int) -> None:
        """Write the stages' ring rows of positions position.. from their `main_x` [B, S, D]
        (`rings`: the cache's DSpark entries; their offsets advance at the call's commit)."""
        for ring, values in zip(rings, self.ring_rows(main_x, position)):
            ring.window.write(values, position)

    def write_rings_stacked(self, caches: list, main_x: mx.array, positions: tuple) -> None:
        """`write_rings` of B sequences at once: main_x [B, S, D], row b at positions[b]..
        of its own rings (`caches[b]`: its DSpark entries). The stages' rows of every
        sequence together, and one ring update per stage (each row at its own position)
        where every ring is allocated and as large; else each its own."""
        for stage, values in enumerate(self.ring_rows(main_x, positions)):
            rings = [entries[stage].window for entries in caches]
            shapes = {row_shape(r, "rows") for r in rings}
            if None in shapes or len(shapes) > 1:
                for ring, rows, position in zip(rings, split_rows(values), positions):
                    ring.write(rows, position)
                continue
            share(rings, "rows", swa_ring_update(stacked_rows(rings, "rows"), values, positions))
            for ring, position in zip(rings, positions):
                ring.advanced(position, values.shape[1])

    def ring_keys(self, ring, position: int) -> Optional[mx.array]:
        """A stage ring's rows of the last `sliding_window` positions before `position`, in
        the reference's key order (slot = position mod window)."""
        window = self.cfg.sliding_window
        first = max(0, position - window)
        if position == first:
            return None
        positions = mx.arange(first, position)
        order = mx.argsort(positions % window) if position > window else positions - first
        return ring.window.rows_at(positions[order])

    def draft(self, embed: nn.Embedding, lm_head: mx.array, anchor: mx.array,
              rings: list, sample=None, stage_inputs: Optional[dict] = None,
              capture: Optional[dict] = None):
        """One draft pass: the block [anchor, noise...] at positions P.. (P: the rings' offset;
        the anchor is the token for the first position they do not hold; `rings` are the
        cache's DSpark entries, `cache[num_hidden_layers:]`) through the stages, then
        `head`. `stage_inputs` {stage: (streams, pre)} replaces given stages' inputs and
        `capture` receives every stage's (streams, pre) out (block-isolated parity).
        Returns `head`'s (tokens, logits, confidence)."""
        streams, pre = self.block_inputs(embed, anchor)
        for k, stage in enumerate(self.stages):
            streams, pre = (stage_inputs or {}).get(k, (streams, pre))
            position = rings[k].offset
            streams, pre = stage(streams, pre, self.ring_keys(rings[k], position), position)
            if capture is not None:
                capture[k] = (streams, pre)
        return self.head(streams, pre, lm_head, anchor, sample)

    def block_inputs(self, embed: nn.Embedding, anchor: mx.array):
        """The block [a, noise x (block - 1)] embedded as 4 copies, and the one-hot `pre`."""
        cfg = self.cfg
        batch = anchor.shape[0]
        noise = mx.full((batch, cfg.dspark_block_size - 1), cfg.dspark_noise_token_id, mx.int32)
        x = embed(mx.concatenate([anchor.reshape(batch, 1).astype(mx.int32), noise], axis=1))
        streams = mx.broadcast_to(x[:, :, None], x.shape[:2] + (cfg.hc_mult, x.shape[-1]))
        pre = mx.zeros(x.shape[:2] + (cfg.hc_mult,), dtype=mx.float32)
        return streams, mx.concatenate([pre[..., :1] + 1, pre[..., 1:]], axis=-1)

    def head(self, streams, pre, lm_head: mx.array, anchor: mx.array, sample=None):
        """Collapse, norm, base logits, then the Markov chain and confidence per row.

        Returns (tokens [B, block + 1] with the anchor first, logits [B, block, V] fp32 per row
        given the previous draft, confidence logits [B, block] fp32). `sample(logits) -> ids`
        draws each draft (argmax when None)."""
        collapsed = collapse(streams, pre)
        base = head_logits(self.norm(collapsed), lm_head)
        embed = self.markov_head.embed
        head = self.markov_head.head.astype(mx.float32)
        proj = self.confidence_head.proj.astype(mx.float32)
        token, tokens, logits, confidence = anchor.reshape(-1).astype(mx.int32), [], [], []
        tokens.append(token)
        for r in range(base.shape[1]):
            e = embed[token]                                             # [B, rank] bf16
            row = base[:, r] + e.astype(mx.float32) @ head.T
            features = mx.concatenate([collapsed[:, r].astype(mx.float32),
                                       e.astype(mx.float32)], axis=-1)
            confidence.append((features @ proj.T)[:, 0])
            token = (mx.argmax(row, axis=-1) if sample is None else sample(row)).astype(mx.int32)
            tokens.append(token)
            logits.append(row)
        return mx.stack(tokens, 1), mx.stack(logits, 1), mx.stack(confidence, 1)
