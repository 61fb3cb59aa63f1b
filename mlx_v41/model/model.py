"""The V4.1 text model: embedding, 4-copy residual stream through the backbone blocks (Engram
before its layers), final collapse with the last block's FFN-side mix, RMSNorm and fp32 head
(spec model.md §1–2, §7). DSpark stages and vision are not part of this module.
"""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .attention import Attention, ForwardContext
from ..cache.layer import ENGRAM_KEPT, LayerCache, rollback_limit
from .config import ModelArgs, TextConfig
from .engram import Engram
from .engram_hash import EngramHasher
from .mhc import HyperConnection, collapse, expand
from ..kernels import Kernels
from .schedule import ced_halo, decoder_start, layer_roles
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

    def __call__(self, streams, pre_in, ctx: ForwardContext, cache: LayerCache,
                 n_out: Optional[int] = None):
        """streams [B, n_in, n, D] (the last n_in positions of the call) and the previous
        block's FFN-side `pre` -> (streams, pre) of the last `n_out` positions."""
        n_in = streams.shape[1]
        n_out = n_in if n_out is None else n_out
        if self.role.engram_index is not None:
            rows = ctx.engram_rows[:, -n_in:, self.role.engram_index]
            streams = self.engram(streams, rows)
        u = self.attention_input(streams, pre_in)
        streams = streams[:, n_in - n_out:]
        a_pre, a_post, a_comb = self.attn_hc(streams)
        streams = expand(self.self_attn(u, ctx, cache, n_out), streams, a_post, a_comb)
        f_pre, f_post, f_comb = self.ffn_hc(streams)
        u = self.mlp(self.post_attention_layernorm(collapse(streams, a_pre)))
        streams = expand(u, streams, f_post, f_comb)
        ctx.record(f"layers.{self.role.layer}.out", streams)
        return streams, f_pre

    def attention_input(self, streams, pre_in):
        """`attn_norm(hc_pre(X, pre of the previous block))` (the single-pass shift)."""
        return self.input_layernorm(collapse(streams, pre_in))


class TextModel(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.roles = layer_roles(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight = self.embed_tokens.weight.astype(mx.bfloat16)
        self.layers = [Block(cfg, self.roles[i]) for i in range(cfg.num_hidden_layers)]
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_mult = cfg.hc_mult
        self.decoder_start = decoder_start(cfg)
        self.cfg = cfg

    def embed(self, ids: mx.array):
        """Token embeddings as the 4 residual copies, and layer 0's one-hot `pre`."""
        batch, length = ids.shape
        x = self.embed_tokens(ids)
        streams = mx.broadcast_to(x[:, :, None, :], (batch, length, self.hc_mult, x.shape[-1]))
        pre = mx.zeros((batch, length, self.hc_mult), dtype=mx.float32)
        return streams, mx.concatenate([pre[..., :1] + 1, pre[..., 1:]], axis=-1)

    def encode(self, ids, ctx: ForwardContext, full: bool):
        """Layers below the decoder over every row; with `full=False` also the first decoder
        layer's global KV for every row (CED step 2). Returns (streams, pre) entering it."""
        streams, pre = self.embed(ids)
        for layer, cache in zip(self.layers[:self.decoder_start], ctx.caches):
            streams, pre = layer(streams, pre, ctx, cache)
        d = self.decoder_start
        if not full and d < len(self.layers) and self.layers[d].role.mode == "full":
            u = self.layers[d].attention_input(streams, pre)
            self.layers[d].self_attn.compress(u, ctx, ctx.caches[d])
            ctx.precompressed.add(d)
        return streams, pre

    def decode(self, streams, pre, ctx: ForwardContext, halo: Optional[list]):
        """Decoder layers; `halo[k]` = (rows in, rows out) of decoder layer k, None = all."""
        for k, (layer, cache) in enumerate(zip(self.layers[self.decoder_start:],
                                               ctx.caches[self.decoder_start:])):
            n_in, n_out = (streams.shape[1],) * 2 if halo is None else halo[k]
            streams, pre = layer(streams[:, -n_in:], pre[:, -n_in:], ctx, cache, n_out)
        return self.norm(collapse(streams, pre))

    def halo(self, rows: int, mode: str, rollback: int = 0) -> Optional[list]:
        """Rows each decoder layer reads and computes: exact CED (`layer_roles.ced_halo`,
        extended for a trim of `rollback` tokens), the bounded replay of cache.md §5, or
        None (every row) for a full prefill."""
        if mode == "full":
            return None
        if mode == "ced_replay":
            span = min(rows, self.cfg.sliding_window)
            return [(span, span)] * (len(self.layers) - self.decoder_start)
        return ced_halo(self.cfg, rows, rollback)


PREFILL_MODES = ("ced", "full", "ced_replay")


class _Progress:
    """After each chunk of a multi-chunk prefill: evaluates its result and the cache (so the
    chunk's graph is freed and memory stays bounded, as in mlx-lm), then reports the running
    token count when asked to. A single chunk stays lazy (decode steps pipeline)."""

    def __init__(self, callback, total: int, cache: list, chunks: int):
        self.callback, self.total, self.done = callback, total, 0
        self.cache, self.chunks = cache, chunks

    def __call__(self, value, chunk: mx.array):
        if self.chunks > 1 or self.callback is not None:
            mx.eval(value, [c.state for c in self.cache] if self.chunks > 1 else [])
        if self.callback is not None:
            self.done += chunk.shape[1]
            self.callback(self.done, self.total)
        return value


class Model(nn.Module):
    """`logits = model(ids, cache=cache)`: ids int [B, S], logits float32 [B, S, vocab]."""

    def __init__(self, args: ModelArgs, compat_reference_index_k_bug: bool = False,
                 prefill_mode: str = "ced", ced_rollback: Optional[int] = None):
        super().__init__()
        if prefill_mode not in PREFILL_MODES:
            raise ValueError(f"prefill_mode must be one of {PREFILL_MODES}, got {prefill_mode!r}")
        cfg = args.text_config
        # Tokens a trim can undo right after a CED prefill. Default: what the window rings
        # allow after decoding too (window + 1), so every prefill mode trims alike.
        most = rollback_limit(cfg.sliding_window)
        ced_rollback = most if ced_rollback is None else ced_rollback
        if not (isinstance(ced_rollback, int) and 0 <= ced_rollback <= most):
            raise ValueError(f"ced_rollback must be an int in [0, {most}] (window + 1), got "
                             f"{ced_rollback!r}")
        self.ced_rollback = ced_rollback
        self.args, self.cfg = args, cfg
        self.model = TextModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.compat_reference_index_k_bug = compat_reference_index_k_bug
        self.prefill_mode = prefill_mode
        self.engram_hasher: Optional[EngramHasher] = None
        self.kernels = Kernels()  # Metal kernels when available; tests inject the simulator's
        ones = [s for s in cfg.kv_source_layer_ids if cfg.compress_ratios[s] == 1]
        self._compat_source = max(ones) if ones else None

    @property
    def roles(self):
        return self.model.roles

    def make_cache(self) -> list:
        cfg = self.cfg
        return [LayerCache(cfg.sliding_window, role.ratio, role.mode == "full",
                           role.engram_index is not None)
                for role in self.roles[:cfg.num_hidden_layers]]

    def __call__(self, ids, cache: Optional[list] = None, last_only: bool = False,
                 capture: Optional[dict] = None) -> mx.array:
        """Logits of `ids` [B, S] continuing `cache`.

        Args:
            last_only: return only the last position's logits ([B, 1, vocab]); then the
                decoder runs only where the prefill mode needs it (exact CED by default).
                Logits of every position always run every layer over every row.
            capture: a dict that receives intermediates named like the reference goldens
                (`layers.L.out`, `layers.L.indexer.score`, `layers.L.indexer.topk`).
        """
        return self.prefill(ids, cache, step_size=None, last_only=last_only, capture=capture)

    def prefill(self, ids, cache: Optional[list] = None, step_size: Optional[int] = None,
                last_only: bool = True, capture: Optional[dict] = None,
                progress: Optional[Callable[[int, int], None]] = None) -> mx.array:
        """Run `ids` [B, S] in chunks of `step_size` rows (the encoder; the CED decoder halo
        runs once at the end); returns the last position's logits [B, 1, vocab] (or every
        position's with `last_only=False`, which runs every chunk fully). `progress(done,
        total)` is called after each evaluated chunk."""
        ids = ids if isinstance(ids, mx.array) else mx.array(ids)
        ids = (ids[None] if ids.ndim == 1 else ids).astype(mx.int32)
        cache = self.make_cache() if cache is None else cache
        end = cache[0].offset + ids.shape[1]
        if end > self.cfg.max_position_embeddings:
            raise ValueError(f"positions up to {end - 1} exceed max_position_embeddings "
                             f"{self.cfg.max_position_embeddings}")
        step = step_size or max(ids.shape[1], 1)
        chunks = [ids[:, i:i + step] for i in range(0, ids.shape[1], step)]
        mode = self.prefill_mode if last_only else "full"
        if mode != "full" and any(e >= self.model.decoder_start for e in self.cfg.engram_layer_ids):
            mode = "full"
        report = _Progress(progress, ids.shape[1], cache, len(chunks))
        if mode == "full":
            outs = [report(self._full(chunk, cache, last_only, capture), chunk)
                    for chunk in chunks]
            return outs[-1] if last_only else mx.concatenate(outs, axis=1)
        return self._ced(chunks, cache, mode, capture, report)

    def _context(self, cache, start, end, capture) -> ForwardContext:
        return ForwardContext(start=start, end=end, caches=cache,
                              compat_index_k_bug=self.compat_reference_index_k_bug,
                              compat_index_k_source=self._compat_source, capture=capture,
                              kernels=self.kernels)

    def _full(self, ids, cache, last_only, capture) -> mx.array:
        start = cache[0].offset
        ctx = self._context(cache, start, start + ids.shape[1], capture)
        ctx.engram_rows = self._engram_rows(ids, cache)
        streams, pre = self.model.encode(ids, ctx, full=True)
        hidden = self.model.decode(streams, pre, ctx, halo=None)
        self._advance(cache, ctx.end)
        return self._logits(hidden, last_only)

    def _ced(self, chunks, cache, mode, capture, report) -> mx.array:
        """Encoder (and the first decoder layer's global KV) chunk by chunk, then the decoder
        over the halo rows of the whole call (cache.md §4; §5 for `ced_replay`)."""
        start = cache[0].offset
        end = start + sum(c.shape[1] for c in chunks)
        halo = self.model.halo(end - start, mode, self.ced_rollback)
        keep = halo[0][0] if halo else 1
        tail = None  # (streams, pre) of the last `keep` rows so far: memory bounded by the halo
        for chunk in chunks:
            chunk_start = cache[0].offset
            ctx = self._context(cache, chunk_start, chunk_start + chunk.shape[1], capture)
            ctx.engram_rows = self._engram_rows(chunk, cache)
            streams, pre = self.model.encode(chunk, ctx, full=False)
            streams, pre = streams[:, -keep:], pre[:, -keep:]
            if tail is not None:
                streams = mx.concatenate([tail[0], streams], axis=1)[:, -keep:]
                pre = mx.concatenate([tail[1], pre], axis=1)[:, -keep:]
            tail = report((streams, pre), chunk)
            for c in cache[:self.model.decoder_start + 1]:
                c.offset = ctx.end
        streams, pre = tail
        ctx = self._context(cache, start, end, capture)
        ctx.precompressed.add(self.model.decoder_start)
        ctx.truncate_window = mode == "ced_replay" and end - start > self.cfg.sliding_window
        hidden = self.model.decode(streams, pre, ctx, halo)
        self._advance(cache, end)
        return self._logits(hidden, True)

    def _logits(self, hidden, last_only) -> mx.array:
        if last_only:
            hidden = hidden[:, -1:]
        return hidden.astype(mx.float32) @ self.lm_head.weight.T

    @staticmethod
    def _advance(cache, end: int) -> None:
        for c in cache:
            c.offset = end

    def _engram_rows(self, ids: mx.array, cache: list) -> Optional[mx.array]:
        """Engram table rows of the chunk, hashed with the cache's compressed-id history."""
        layers = self.cfg.engram_layer_ids
        if not layers:
            return None
        if self.engram_hasher is None:
            raise RuntimeError("this model has Engram layers but no token map was loaded; "
                               "use mlx_v41.load_model(path)")
        hasher = self.engram_hasher
        batch = ids.shape[0]
        seen = cache[layers[0]].engram_ids
        if seen.shape[0] != batch:
            seen = np.broadcast_to(seen[:1], (batch, seen.shape[1]))
        history = np.full((batch, hasher.history_length), -1, np.int64)
        tail = seen[:, -hasher.history_length:] if seen.shape[1] else seen
        if tail.shape[1]:
            history[:, -tail.shape[1]:] = tail
        compressed = hasher.compress(np.array(ids))
        rows, _ = hasher.hash_compressed(compressed, history)
        # Only the recent ids are kept: a full history would be copied on every token.
        ids_so_far = np.concatenate([seen[:, -ENGRAM_KEPT:], compressed.astype(np.int32)],
                                    axis=1)[:, -ENGRAM_KEPT:]
        for layer in layers:
            cache[layer].engram_ids = ids_so_far
        return mx.array(rows.astype(np.int32))
