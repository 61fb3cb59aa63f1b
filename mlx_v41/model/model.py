"""The V4.1 text model: embedding, 4-copy residual stream through the backbone blocks (Engram
before its layers), final collapse with the last block's FFN-side mix, RMSNorm and fp32 head
(official inference/model.py `Transformer.forward`). The backbone is two stacks: the causal
encoder (layers below the first ratio-1 kv owner) and the decoder; how a call runs them over a
prompt (full, exact CED, bounded replay, chunking) is `prefill.py`. DSpark stages and the vision
tower are attached here but defined in `dspark.py` and `vision/`.
"""

from __future__ import annotations

import warnings
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn

from ..cache.layer import LayerCache, rollback_limit
from ..kernels import Kernels
from ..kernels.context import settle
from ..kernels.norm import norm
from ..numerics.mhc import expand
from .attention import Attention
from .config import ModelArgs, TextConfig
from .dspark import DSpark
from .engram import Engram
from .engram_hash import EngramHasher
from .layers import HEAD_DTYPES, RMSNorm, head_logits
from .mhc import HyperConnection
from .moe import MoE
from .paired import pair_projections
from .prefill import PREFILL_MODES, ModelOutput, run_forward
from .schedule import decoder_start, layer_roles
from .shared import BlockInputs, ForwardState
from .vision.aligner import Aligner
from .vision.spans import ImageInputs
from .vision.vit import VisionTransformer


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

    def __call__(self, streams, pre, state: ForwardState, cache: LayerCache,
                 n_out: Optional[int] = None, mixes: Optional[tuple] = None,
                 hand_to: Optional[HyperConnection] = None):
        """One block over the last n_in positions of the call.

        Args:
            streams: [B, n_in, n, D] the residual copies entering the block; pre: [B, n_in, n]
                the previous block's FFN-side `pre` (the single-pass shift).
            n_out: the rows whose outputs are wanted (the last ones; default all). Every row
                gets its window KV; only these are queries.
            mixes: this block's attention-side (pre, post, comb) of `streams`, when the
                previous block made them with its last expand; None: made here.
            hand_to: the next block's attention-side `HyperConnection`, to make its mixes with
                this block's last expand (one launch where that kernel fuses them).
        Returns:
            (streams [B, n_out, n, D], pre [B, n_out, n], the mixes made for `hand_to` or None).
        """
        n_in = streams.shape[1]
        n_out = n_in if n_out is None else n_out
        if state.probe is not None:  # teacher-forced inputs (block-isolated parity)
            streams, pre, mixes = state.probe.block_inputs(self.role.layer, streams, pre, mixes)
        state.taps.record(self.role.layer, streams)
        if self.role.engram_index is not None:
            streams = self.engram(streams, state.engram_rows[:, -n_in:, self.role.engram_index],
                                  state.image_positions(n_in))
            settle(streams)
            state.record(f"layers.{self.role.layer}.engram_out", streams)
        # attention side: collapse -> norm -> attention -> expand (with the FFN side's mixes)
        u, u_fp8 = self.attention_input(streams, pre, with_fp8=True)
        settle(u, u_fp8)
        streams = streams[:, n_in - n_out:]
        a_pre, a_post, a_comb = self.attn_hc(streams) if mixes is None else last_rows(mixes, n_out)
        y = self.self_attn(u, state, cache, n_out, products=True, prepared=u_fp8)
        streams, f_pre, f_post, f_comb = self.ffn_hc.after_expand(y, streams, a_post, a_comb)
        # FFN side: collapse -> norm -> MoE -> expand (with the next block's mixes)
        u, u32, u_fp8 = self.ffn_input(streams, a_pre)
        settle(u, u32, u_fp8)
        y = self.mlp(u, state.image_positions(n_out), self.gate_recorder(state), u32,
                     x_fp8=u_fp8)
        if hand_to is None:
            streams, mixes = expand(y, streams, f_post, f_comb), None
        else:
            streams, *mixes = hand_to.after_expand(y, streams, f_post, f_comb)
        state.record(f"layers.{self.role.layer}.out", streams)
        state.record(f"layers.{self.role.layer}.pre_out", f_pre)
        return streams, f_pre, None if mixes is None else tuple(mixes)

    def takes_mixes(self, state: ForwardState) -> bool:
        """Whether this block's attention-side mixes can be made by the previous block: it
        reads the very streams that block returns (no Engram write, no teacher-forced input)."""
        return self.role.engram_index is None and \
            (state.probe is None or not state.probe.replaces_input(self.role.layer))

    def gate_recorder(self, state: ForwardState):
        if not state.capturing:
            return None
        return lambda name, value: state.record(f"layers.{self.role.layer}.{name}", value)

    def attention_input(self, streams, pre, with_fp8: bool = False):
        """`attn_norm(hc_pre(X, pre of the previous block))` (the single-pass shift); with
        `with_fp8` also its act_fp8 (fp32: the projections' prepared input)."""
        rms = self.input_layernorm
        if not with_fp8:
            return norm(streams, rms.weight, rms.eps, pre=pre)[0]
        return norm(streams, rms.weight, rms.eps, pre=pre, outputs=("y", "fp8"))

    def ffn_input(self, streams, a_pre):
        """`ffn_norm(hc_pre(X, pre))` in bf16 and fp32 (the router reads fp32) and its act_fp8
        (fp32: the experts' input)."""
        rms = self.post_attention_layernorm
        return norm(streams, rms.weight, rms.eps, pre=a_pre, outputs=("y", "y32", "fp8"))


def last_rows(mixes: tuple, rows: int) -> tuple:
    """Per-token mixes (pre, post, comb) of the last `rows` positions."""
    return tuple(m[:, m.shape[1] - rows:] for m in mixes)


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

    def residual_input(self, x: mx.array):
        """Embeddings [B, S, D] as the 4 residual copies, and layer 0's one-hot `pre`."""
        batch, length, dim = x.shape
        streams = mx.broadcast_to(x[:, :, None, :], (batch, length, self.hc_mult, dim))
        pre = mx.zeros((batch, length, self.hc_mult), dtype=mx.float32)
        return streams, mx.concatenate([pre[..., :1] + 1, pre[..., 1:]], axis=-1)

    def encoder_stack(self, streams, pre, state: ForwardState, cache: list):
        """The causal encoder's layers over every row of the call -> (streams, pre) entering
        the decoder."""
        layers, mixes = self.layers[:self.decoder_start], None
        for k, (layer, c) in enumerate(zip(layers, cache)):
            streams, pre, mixes = layer(streams, pre, state, c, mixes=mixes,
                                        hand_to=_receiver(layers, k + 1, state))
        return streams, pre

    def decoder_stack(self, streams, pre, state: ForwardState, cache: list,
                      halo: Optional[list] = None):
        """Decoder layers, then the final collapse and norm. `halo[k]` = (rows in, rows out)
        of decoder layer k; None = every row."""
        return self.decoder_output(self.decoder_layers((streams, pre, None), state, cache, halo))

    def decoder_layers(self, carry: tuple, state: ForwardState, cache: list,
                       halo: Optional[list] = None, first: int = 0,
                       stop: Optional[int] = None) -> tuple:
        """Decoder layers `first` to `stop` - 1 (k counted from the first decoder layer) over
        carry = (streams, pre, mixes made for layer `first` or None) -> the carry of layer
        `stop`. A paced CED halo runs the stack in such pieces: the same ops as one pass."""
        layers, (streams, pre, mixes) = self.layers[self.decoder_start:], carry
        for k in range(first, len(layers) if stop is None else stop):
            n_in, n_out = (streams.shape[1],) * 2 if halo is None else halo[k]
            if n_in < streams.shape[1]:
                streams, pre = streams[:, -n_in:], pre[:, -n_in:]
                mixes = None if mixes is None else last_rows(mixes, n_in)
            streams, pre, mixes = layers[k](streams, pre, state, cache[self.decoder_start + k],
                                            n_out, mixes=mixes,
                                            hand_to=_receiver(layers, k + 1, state))
        return streams, pre, mixes

    def decoder_output(self, carry: tuple) -> mx.array:
        """The final collapse and norm of the last decoder layer's carry."""
        streams, pre, _ = carry
        return norm(streams, self.norm.weight, self.norm.eps, pre=pre)[0]


def _receiver(layers: list, k: int, state: ForwardState) -> Optional[HyperConnection]:
    """Layer k's attention-side mixes, if the layer before may make them (`takes_mixes`)."""
    if k >= len(layers) or not layers[k].takes_mixes(state):
        return None
    return layers[k].attn_hc


class Model(nn.Module):
    """`logits = model(ids, cache=cache)`: ids int [B, S], logits float32 [B, S, vocab]."""

    def __init__(self, args: ModelArgs, compat_reference_index_k_bug: bool = False,
                 prefill_mode: str = "ced", ced_rollback: Optional[int] = None,
                 dspark: bool = False, vision: bool = False, head_dtype: str = "float32"):
        super().__init__()
        if prefill_mode not in PREFILL_MODES:
            raise ValueError(f"prefill_mode must be one of {PREFILL_MODES}, got {prefill_mode!r}")
        if head_dtype not in HEAD_DTYPES:
            raise ValueError(f"head_dtype must be one of {HEAD_DTYPES}, got {head_dtype!r}")
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
        self.lm_head.weight = self.lm_head.weight.astype(getattr(mx, head_dtype))
        if dspark:  # the drafter's stages and heads (`mtp.*`); embed and head are shared
            self.dspark = DSpark(cfg)
        if vision:  # the image tower under its published names: vision.*, aligner.*, image_*
            vc = args.vision_config
            self.vision = VisionTransformer(vc)
            self.aligner = Aligner(vc.hidden_size, vc.downsample_ratio, cfg.hidden_size)
            self.image_start, self.image_end, self.image_newline = (
                mx.zeros((cfg.hidden_size,), dtype=mx.bfloat16) for _ in range(3))
        self.compat_reference_index_k_bug = compat_reference_index_k_bug
        self.prefill_mode = _usable_mode(cfg, prefill_mode, self.model.decoder_start)
        self.engram_hasher: Optional[EngramHasher] = None
        self.pairs = 0  # paired projections (`pair_projections`)
        self.kernels = Kernels()  # Metal kernels when available; tests inject the simulator's
        ones = [s for s in cfg.kv_source_layer_ids if cfg.compress_ratios[s] == 1]
        self.compat_source = max(ones) if ones and compat_reference_index_k_bug else None

    def pair_projections(self) -> int:
        """Make the projections that read one input one matmul each (`paired.py`; the same
        bits). The loader calls it once the weights are in; returns how many pairs."""
        self.pairs = pair_projections(self)
        return self.pairs

    def update(self, parameters: dict, strict: bool = True) -> "Model":
        """`nn.Module.update` (and so `load_weights`); once paired, the pairs are made again
        from the new arrays, so a replaced weight is never read stale."""
        super().update(parameters, strict=strict)
        if self.pairs:
            self.pair_projections()
        return self

    @property
    def roles(self):
        return self.model.roles

    def make_cache(self) -> list:
        """One `LayerCache` per backbone layer, then (with the drafter loaded) one per DSpark
        stage holding only its window ring."""
        cfg = self.cfg
        cache = [LayerCache(cfg.sliding_window, role.ratio, role.mode == "full",
                            role.engram_index is not None)
                 for role in self.roles[:cfg.num_hidden_layers]]
        stages = self.cache_length - cfg.num_hidden_layers
        # A draft attends the `sliding_window` positions before the block (the backbone's
        # window holds one fewer before its query), hence the one-row-wider ring.
        return cache + [LayerCache(cfg.sliding_window + 1) for _ in range(stages)]

    @property
    def cache_length(self) -> int:
        """Layers of a `make_cache()` list: the backbone's, then the drafter's stages."""
        return self.cfg.num_hidden_layers + (len(self.dspark.stages) if "dspark" in self else 0)

    def __call__(self, ids, cache: Optional[list] = None, last_only: bool = False,
                 capture: Optional[dict] = None,
                 input_embeddings: Optional[mx.array] = None,
                 images: Optional[ImageInputs] = None) -> mx.array:
        """Logits of `ids` [B, S] continuing `cache`.

        Args:
            last_only: return only the last position's logits ([B, 1, vocab]); then the
                decoder runs only where the prefill mode needs it (exact CED by default).
                Logits of every position always run every layer over every row.
            capture: a dict that receives intermediates named like the reference goldens
                (`layers.L.out`, `layers.L.pre_out`, `layers.L.engram_out`,
                `layers.L.indexer.score`, `layers.L.indexer.topk`).
            input_embeddings: [B, S, hidden] to use instead of the token embeddings;
                `ids` still give the positions and the Engram n-grams.
            images: the image spans of the call (`vision.ImageInputs`, batch 1): their rows
                replace the token embeddings there, their experts are chosen with
                `bias_vl`, and Engram skips them.
        """
        return self.forward(ids, cache, last_only=last_only, capture=capture,
                            input_embeddings=input_embeddings, images=images).logits

    def forward(self, ids, cache: Optional[list] = None, *, last_only: bool = False,
                step_size: Optional[int] = None, input_embeddings: Optional[mx.array] = None,
                images: Optional[ImageInputs] = None,
                taps: tuple = (), teacher: Optional[BlockInputs] = None,
                capture: Optional[dict] = None,
                progress: Optional[Callable[[int, int], None]] = None) -> ModelOutput:
        """One call over `ids` [B, S] continuing `cache`, in chunks of `step_size` rows.

        Atomic: the cache advances only when the whole call succeeds; any exception (a
        progress callback that raises, Ctrl-C) leaves it exactly as it was.

        Args:
            taps: layer ids whose entering streams are returned (`ModelOutput.taps`).
            teacher: `BlockInputs` replacing given blocks' inputs, selections and candidate
                pools (block-isolated parity checks); runs every row of every layer.
            progress: called as (tokens done, total) after each evaluated chunk.
        Others as in `__call__`.
        """
        return run_forward(self, ids, cache, last_only=last_only, step_size=step_size,
                           embeddings=input_embeddings, images=images, taps=tuple(taps),
                           teacher=teacher, capture=capture, progress=progress)

    def prefill(self, ids, cache: Optional[list] = None, step_size: Optional[int] = None,
                last_only: bool = True, capture: Optional[dict] = None,
                progress: Optional[Callable[[int, int], None]] = None,
                images: Optional[ImageInputs] = None) -> mx.array:
        """Run `ids` [B, S] in chunks of `step_size` rows (the encoder; the CED decoder halo
        runs once at the end); returns the last position's logits [B, 1, vocab] (or every
        position's with `last_only=False`, which runs every chunk fully). `progress(done,
        total)` is called after each evaluated chunk; `images` as in `__call__`."""
        return self.forward(ids, cache, last_only=last_only, step_size=step_size,
                            capture=capture, progress=progress, images=images).logits

    @property
    def drafting(self) -> bool:
        """Whether forwards feed the DSpark drafter's rings (and speculative decoding runs)."""
        return "dspark" in self

    def head(self, hidden: mx.array, last_only: bool) -> mx.array:
        """fp32 logits of the normed hidden rows (all, or the last)."""
        if last_only:
            hidden = hidden[:, -1:]
        return head_logits(hidden, self.lm_head.weight)


def _usable_mode(cfg: TextConfig, mode: str, start: int) -> str:
    """An encoder-only prefill needs every Engram layer in the encoder (the decoder's halo
    rows would need the n-grams of earlier chunks); otherwise say so once and run `full`."""
    late = [e for e in cfg.engram_layer_ids if e >= start]
    if mode != "full" and late:
        warnings.warn(f"prefill_mode {mode!r} needs every Engram layer below the decoder (layer "
                      f"{start}); Engram layer {late[0]} is not, so prefills run 'full'",
                      stacklevel=3)
        return "full"
    return mode
