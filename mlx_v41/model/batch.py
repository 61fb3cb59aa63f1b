"""One forward over several sequences at once, each continuing its own cache.

B sequences at different positions (their own window rings, compressed rows, open
compressor groups, Engram histories) run one call of n rows each: the embedding, every
projection, expert, mHC mix and norm, and the head run over all B x n rows together; each
sequence's attention reads and writes only its own cache (`Attention._attend` with the
sequence's `ForwardState`, through `shared.BatchState`). Nothing is copied between
sequences: a batch is just the list of their caches, so a sequence joins or leaves between
two calls by being in the list or not.

On MLX's CPU backend every op the shared part runs gives each row the bits it gets alone, so
each sequence's logits equal a batch-1 call's exactly (tests/test_batch.py); see
docs/batching.md for GPUs.
"""

from __future__ import annotations

from typing import Sequence

from ..cache.layer import commit, transaction
from ..kernels.context import using
from .engram import engram_rows_stacked
from .prefill import ModelOutput, _as_ids, draft_ring_rows
from .shared import BatchState, ForwardState, Taps, shared_state


def batch_forward(model, ids, caches: Sequence[list]) -> ModelOutput:
    """Logits [B, n, vocab] of `ids` [B, n]: row b continues `caches[b]` (a `make_cache()`
    list holding one sequence, or empty). Every layer runs every row (a decode step, or a
    DSpark verify block); prompts prefill alone (`Model.prefill`, `forward_steps`).

    Atomic over the whole batch: every cache advances by n, or (on any exception) none
    changes. `ModelOutput.taps` holds the DSpark target layers' taps [B, rows, D] when the
    drafter is loaded.
    """
    ids = _as_ids(ids)
    batch, length = ids.shape
    caches = list(caches)
    _check(model, ids, caches)
    text = model.model
    states = [ForwardState(start=cache[0].offset, end=cache[0].offset + length,
                           shared=shared_state(cache, text.roles),
                           compat_index_k_source=model.compat_source) for cache in caches]
    drafting = model.drafting
    targets = tuple(model.cfg.dspark_target_layer_ids) if drafting else ()
    taps = Taps(targets, caches[0][-1].window.capacity if drafting else None)
    by_layer = [list(layer) for layer in zip(*caches)]  # layer -> that layer of each sequence
    everything = [c for cache in caches for c in cache]
    with transaction(everything), using(model.kernels):
        rows = engram_rows_stacked(model.engram_hasher, model.cfg.engram_layer_ids, ids,
                                   caches)
        state = BatchState(states, rows, taps=taps)
        streams, pre = text.residual_input(text.embed_tokens(ids))
        streams, pre = text.encoder_stack(streams, pre, state, by_layer)
        hidden = text.decoder_stack(streams, pre, state, by_layer)
        logits = model.head(hidden, False)
        if drafting:  # the drafter's rows and ring writes of every sequence at once
            main_x = draft_ring_rows(model, taps.rows)
            layers = model.cfg.num_hidden_layers
            model.dspark.write_rings_stacked([cache[layers:] for cache in caches], main_x,
                                             tuple(seq.end - main_x.shape[1] for seq in states))
        for cache, seq in zip(caches, states):
            commit(cache, seq.end)
    return ModelOutput(logits, dict(taps.rows))


def _check(model, ids, caches: list) -> None:
    """A clear ValueError for a batch the forward cannot run (nothing has changed yet)."""
    batch, length = ids.shape
    if len(caches) != batch:
        raise ValueError(f"ids have {batch} rows but {len(caches)} caches were given (one per "
                         "sequence)")
    if length == 0:
        raise ValueError("ids are empty: a forward needs at least one token per sequence")
    layers = model.cache_length
    seen = set()
    for b, cache in enumerate(caches):
        if not isinstance(cache, list) or len(cache) != layers:
            raise ValueError(f"caches[{b}] is not a cache of this model (make_cache() gives "
                             f"{layers} layers)")
        if id(cache[0]) in seen:
            raise ValueError(f"caches[{b}] is given twice: every sequence needs its own cache")
        seen.add(id(cache[0]))
        if cache[0].batch not in (None, 1):
            raise ValueError(f"caches[{b}] holds batch {cache[0].batch}; a batched forward "
                             "takes one sequence per cache")
        end = cache[0].offset + length
        if end > model.cfg.max_position_embeddings:
            raise ValueError(f"caches[{b}]: positions up to {end - 1} exceed "
                             f"max_position_embeddings {model.cfg.max_position_embeddings}")
