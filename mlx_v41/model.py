"""The V4.1 text model: embedding, 4-copy residual stream through the backbone blocks (Engram
before its layers), final collapse with the last block's FFN-side mix, RMSNorm and fp32 head
(spec model.md §1–2, §7). DSpark stages and vision are not part of this module.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .attention import Attention, ForwardContext
from .cache import LayerCache
from .config import ModelArgs, TextConfig
from .engram import Engram
from .engram_hash import EngramHasher
from .hyper_connections import HyperConnection, collapse, expand
from .layer_roles import layer_roles
from .layers import RMSNorm
from .moe import MoE


class Block(nn.Module):
    def __init__(self, cfg: TextConfig, role):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = Attention(cfg, role)
        self.mlp = MoE(cfg.hidden_size, cfg.moe_intermediate_size, role.n_experts,
                       role.experts_per_tok, cfg.routed_scaling_factor, cfg.swiglu_limit)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        hc = (cfg.hc_mult, cfg.hidden_size, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps)
        self.attn_hc = HyperConnection(*hc)
        self.ffn_hc = HyperConnection(*hc)
        if role.engram_index is not None:
            columns = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
            self.engram = Engram(cfg.hidden_size, cfg.hc_mult,
                                 cfg.engram_num_embeddings[role.engram_index], columns,
                                 cfg.engram_head_dim, eps)
        self.role = role

    def __call__(self, streams, pre_in, ctx: ForwardContext, cache: LayerCache):
        """streams [B, S, n, D] and the previous block's FFN-side `pre` -> (streams, pre)."""
        if self.role.engram_index is not None:
            streams = self.engram(streams, ctx.engram_rows[:, :, self.role.engram_index])
        a_pre, a_post, a_comb = self.attn_hc(streams)
        u = self.self_attn(self.input_layernorm(collapse(streams, pre_in)), ctx, cache)
        streams = expand(u, streams, a_post, a_comb)
        f_pre, f_post, f_comb = self.ffn_hc(streams)
        u = self.mlp(self.post_attention_layernorm(collapse(streams, a_pre)))
        streams = expand(u, streams, f_post, f_comb)
        ctx.record(f"layers.{self.role.layer}.out", streams)
        return streams, f_pre


class TextModel(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.roles = layer_roles(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight = self.embed_tokens.weight.astype(mx.bfloat16)
        self.layers = [Block(cfg, self.roles[i]) for i in range(cfg.num_hidden_layers)]
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_mult = cfg.hc_mult

    def __call__(self, ids: mx.array, ctx: ForwardContext) -> mx.array:
        batch, length = ids.shape
        x = self.embed_tokens(ids)
        streams = mx.broadcast_to(x[:, :, None, :], (batch, length, self.hc_mult, x.shape[-1]))
        pre = mx.zeros((batch, length, self.hc_mult), dtype=mx.float32)
        pre = mx.concatenate([pre[..., :1] + 1, pre[..., 1:]], axis=-1)
        for layer, cache in zip(self.layers, ctx.caches):
            streams, pre = layer(streams, pre, ctx, cache)
        return self.norm(collapse(streams, pre))


class Model(nn.Module):
    """`logits = model(ids, cache=cache)`: ids int [B, S], logits float32 [B, S, vocab]."""

    def __init__(self, args: ModelArgs, compat_reference_index_k_bug: bool = False):
        super().__init__()
        cfg = args.text_config
        self.args, self.cfg = args, cfg
        self.model = TextModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.compat_reference_index_k_bug = compat_reference_index_k_bug
        self.engram_hasher: Optional[EngramHasher] = None
        ones = [s for s in cfg.kv_source_layer_ids if cfg.compress_ratios[s] == 1]
        self._compat_source = max(ones) if ones else None

    @property
    def roles(self):
        return self.model.roles

    def make_cache(self) -> list:
        cfg = self.cfg
        history = cfg.engram_max_ngram_size - 1
        return [LayerCache(cfg.sliding_window, role.ratio, role.mode == "full",
                           history if role.engram_index is not None else 0)
                for role in self.roles[:cfg.num_hidden_layers]]

    def __call__(self, ids, cache: Optional[list] = None, last_only: bool = False,
                 capture: Optional[dict] = None) -> mx.array:
        """Logits of `ids` [B, S] continuing `cache`.

        Args:
            last_only: return only the last position's logits ([B, 1, vocab]).
        """
        ids = mx.array(ids) if not isinstance(ids, mx.array) else ids
        if ids.ndim == 1:
            ids = ids[None]
        cache = self.make_cache() if cache is None else cache
        offset = cache[0].offset
        ctx = ForwardContext(
            positions=mx.arange(offset, offset + ids.shape[1]), offset=offset, caches=cache,
            compat_index_k_bug=self.compat_reference_index_k_bug,
            compat_index_k_source=self._compat_source, capture=capture)
        ctx.engram_rows = self._engram_rows(ids, cache)
        hidden = self.model(ids, ctx)
        for c in cache:
            c.offset = offset + ids.shape[1]
        if last_only:
            hidden = hidden[:, -1:]
        return hidden.astype(mx.float32) @ self.lm_head.weight.T

    def _engram_rows(self, ids: mx.array, cache: list) -> Optional[mx.array]:
        engram_layers = self.cfg.engram_layer_ids
        if not engram_layers:
            return None
        if self.engram_hasher is None:
            raise RuntimeError("this model has Engram layers but no token map was loaded; "
                               "use mlx_v41.load_model(path)")
        first = cache[engram_layers[0]]
        history = first.engram_history
        if history.shape[0] != ids.shape[0]:
            history = np.broadcast_to(history[:1], (ids.shape[0], history.shape[1])).copy()
        rows, new_history = self.engram_hasher.hash(np.array(ids), history)
        for layer in engram_layers:
            cache[layer].engram_history = new_history
        return mx.array(rows.astype(np.int32))
