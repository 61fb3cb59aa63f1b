"""How one call runs the backbone over its rows: every prefill strategy in one place.

* `full`: every layer over every row, chunk by chunk (what the reference does).
* `ced` (exact encoder-only prefill): the causal encoder chunk by chunk, the first decoder
  layer's global KV for every row, then the decoder once over the halo rows its outputs depend
  on (`schedule.ced_halo`); the last position's logits equal a full prefill's.
* `ced_replay`: the tech report's bounded replay, the decoder over the last window only
  (APPROXIMATE, opt-in).
A call is atomic: the cache changes only if it completes (`cache.layer.transaction`). A batch
engine runs a prompt in paced pieces (`prefill_pieces`): chunks sized per step and the halo a
few decoder layers at a time, the same ops and bits as one call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional

import mlx.core as mx

from ..cache.layer import commit, transaction
from ..kernels.context import settle, using
from .engram import engram_rows
from .schedule import FULL, ced_halo
from .shared import ForwardState, Probe, Taps, shared_state
from .vision.prompt import delimiters

PREFILL_MODES = ("ced", "full", "ced_replay")


class Progress:
    """After each chunk of a multi-chunk (or paced) call: evaluates its result and the cache
    (so the chunk's graph is freed and memory stays bounded, as in mlx-lm), then reports the
    running token count when asked to. A single chunk stays lazy (decode steps pipeline)."""

    def __init__(self, callback, total: int, cache: list, is_chunked: bool):
        self.callback, self.total, self.done = callback, total, 0
        self.cache, self.is_chunked = cache, is_chunked

    def __call__(self, value, rows: int):
        if self.is_chunked or self.callback is not None:
            if self.is_chunked:  # a layer at a time where evaluations are kept short
                for c in self.cache:
                    settle(c.state)
            mx.eval(value, [c.state for c in self.cache] if self.is_chunked else [])
        if self.callback is not None and rows:
            self.done += rows
            self.callback(self.done, self.total)
        return value


def run_forward(model, ids, cache: Optional[list], *, last_only: bool, step_size, embeddings,
                taps: tuple, teacher, capture, progress: Optional[Callable], images=None,
                runner=None):
    """`Model.forward`: checks the inputs, picks the strategy, runs it atomically (`runner`:
    a `Run` subclass that overrides some of its steps)."""
    steps = forward_steps(model, ids, cache, last_only=last_only, step_size=step_size,
                          embeddings=embeddings, taps=taps, teacher=teacher, capture=capture,
                          progress=progress, images=images, runner=runner)
    with using(model.kernels):
        return finish(steps)


def finish(steps):
    """Run a `forward_steps` generator to its end; its `ModelOutput`."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def forward_steps(model, ids, cache: Optional[list], *, last_only: bool, step_size=None,
                  embeddings=None, taps: tuple = (), teacher=None, capture=None,
                  progress: Optional[Callable] = None, images=None, runner=None,
                  pace: Optional["Pace"] = None):
    """`run_forward` one chunk at a time: checks the inputs now (a ValueError before anything
    runs), then returns a generator that yields after each chunk and returns the
    `ModelOutput`. The cache changes only when the generator completes; closing it early (or
    an exception) leaves the cache as it was. The caller makes the model's kernels active
    (`kernels.context.using`) around each step; a batch engine interleaves other sequences'
    forwards between the steps of a prompt's. With a `pace` the generator is paced instead
    (`prefill_pieces` drives it)."""
    ids = _as_ids(ids)
    cache = model.make_cache() if cache is None else cache
    _check_inputs(model, ids, cache, embeddings, step_size, teacher)
    check_images(model, ids, embeddings, images)
    start = cache[0].offset
    length = ids.shape[1]
    rows = Rows(ids, embeddings, images, step_size or length)
    mode = "full" if not last_only or teacher is not None else model.prefill_mode
    drafting = model.drafting
    targets = tuple(model.cfg.dspark_target_layer_ids) if drafting else ()
    probe = None if teacher is None and capture is None else Probe(teacher, capture)
    # only the draft rings read the targets' taps: then keep what a ring holds
    keep = cache[-1].window.capacity if drafting and not taps else None
    is_chunked = pace is not None or rows.step < length
    run = (runner or Run)(model, cache, start, Taps(tuple(dict.fromkeys(taps + targets)), keep),
                          probe, Progress(progress, length, cache, is_chunked))
    run.image_mask = None if images is None else images.mask()
    run.rows, run.pace = rows, pace
    return _run_steps(run, mode, last_only, taps, start + length)


def _run_steps(run, mode: str, last_only: bool, taps: tuple, end: int):
    with transaction(run.cache):
        if mode == "full":
            logits = yield from run.full(last_only)
        else:
            logits = yield from run.encoder_only(mode)
        if run.model.drafting:
            run.write_draft_rings(run.taps.rows, end)
        commit(run.cache, end)
    return ModelOutput(logits, {layer: run.taps.rows[layer] for layer in taps})


def write_draft_rings(model, cache: list, taps: dict, end: int) -> None:
    """The DSpark stages' ring rows of the positions every target tap covers (the call's last
    rows), from their `main_x`: what a later draft pass attends."""
    main_x = draft_ring_rows(model, taps)
    model.dspark.write_rings(cache[model.cfg.num_hidden_layers:], main_x,
                             end - main_x.shape[1])


def draft_ring_rows(model, taps: dict) -> mx.array:
    """The drafter's `main_x` [B, rows, D] of the positions every target tap covers (the
    call's last rows): what `write_draft_rings` stores."""
    layers = model.cfg.dspark_target_layer_ids
    rows = min(taps[layer].shape[1] for layer in layers)
    return model.dspark.main_x([taps[layer][:, -rows:] for layer in layers])


@dataclass
class ModelOutput:
    """`Model.forward`'s result: logits [B, S or 1, vocab] float32, and the taps: layer ->
    [B, rows, D] bf16, the mean over the 4 copies of the streams entering that layer for the
    last `rows` positions of the call (every row a layer computed; fewer in a CED decoder)."""

    logits: mx.array
    taps: dict = field(default_factory=dict)


class Chunk(NamedTuple):
    """Rows of one chunk of a call: ids [B, n], optional embeddings [B, n, D] and images."""

    ids: mx.array
    embeddings: Optional[mx.array]
    images: Optional[object]  # vision.ImageInputs of the chunk's positions


class Rows:
    """A call's rows, taken in order one chunk at a time: `step` rows each, or as many as the
    caller asks for (any split gives the same bits). A chunk without span positions has no
    images."""

    def __init__(self, ids: mx.array, embeddings, images, step: int):
        self.ids, self.embeddings, self.images, self.step = ids, embeddings, images, step
        self.length, self.taken = ids.shape[1], 0

    @property
    def left(self) -> int:
        return self.length - self.taken

    def take(self, size: Optional[int] = None) -> Chunk:
        begin = self.taken
        end = self.taken = min(self.length, begin + (size or self.step))
        part = None if self.images is None else self.images.chunk(begin, end)
        return Chunk(self.ids[:, begin:end],
                     None if self.embeddings is None else self.embeddings[:, begin:end],
                     part if part is not None and part.has_spans else None)


@dataclass
class Pace:
    """A paced call's work, in prompt tokens: an encoder (or full-model) chunk row is 1, a
    CED halo decoder layer over r rows is r / (encoder layers), the rows a prompt token
    passes. The caller sends each piece's `allowance`; after it, `done` is the piece's work,
    `left` the call's work still to do and `next` the next piece's work run whole (a chunk
    of `step_size` rows or what is left, or the next halo layer); `in_halo` once the chunks
    are done."""

    allowance: float = 0.0
    done: float = 0.0
    left: float = 0.0
    next: float = 0.0
    in_halo: bool = False


class Pieces:
    """A last-position prefill run one paced piece at a time, between other work (a batch
    engine's prompt, `prefill_pieces`). `run(allowance)` runs the next piece: a chunk of at
    most `allowance` rows (and `step_size`), or as many CED halo decoder layers as fit
    `allowance` (at least one); it returns the `ModelOutput` after the last piece, else None.
    `pace` says what each piece did and what is left. `close()` abandons the call (the cache
    is left as it was)."""

    def __init__(self, steps, pace: Pace):
        self.steps, self.pace = steps, pace
        next(steps)  # to the first piece: nothing has run yet

    def run(self, allowance: float) -> Optional["ModelOutput"]:
        pace = self.pace
        pace.done = 0.0
        try:
            self.steps.send(allowance)
        except StopIteration as end:
            pace.done, pace.left, pace.next = pace.left, 0.0, 0.0
            return end.value
        return None

    def close(self) -> None:
        self.steps.close()


def prefill_pieces(model, ids, cache: Optional[list], *, step_size: Optional[int] = None,
                   images=None, progress: Optional[Callable] = None) -> Pieces:
    """A last-position prefill of `ids` into `cache` run in paced pieces (`Pieces`): the same
    logits and cache, bit for bit, as `Model.prefill` with any `step_size`. Checks the inputs
    now (a ValueError before anything runs)."""
    pace = Pace()
    return Pieces(forward_steps(model, ids, cache, last_only=True, step_size=step_size,
                                images=images, progress=progress, pace=pace), pace)


class Run:
    """One call's strategies over its chunks, from position `start` of `cache`."""

    def __init__(self, model, cache: list, start: int, taps: Taps, probe: Optional[Probe],
                 report):
        self.model, self.text, self.cache, self.start = model, model.model, cache, start
        self.taps, self.probe, self.report = taps, probe, report
        self.image_mask = None  # [B, S] bool over the whole call, when it has images
        self.rows: Optional[Rows] = None  # the call's rows (`forward_steps` sets them)
        self.pace: Optional[Pace] = None  # a paced call's (`prefill_pieces`)

    def state(self, start: int, end: int) -> ForwardState:
        return ForwardState(start=start, end=end, shared=shared_state(self.cache, self.text.roles),
                            compat_index_k_source=self.model.compat_source, taps=self.taps,
                            probe=self.probe)

    def encode(self, chunk: Chunk, start: int):
        """The encoder stack over one chunk at `start` -> (state, streams, pre)."""
        state = self.state(start, start + chunk.ids.shape[1])
        streams, pre = self.embed(chunk, state)
        return (state, *self.text.encoder_stack(streams, pre, state, self.cache))

    def embed(self, chunk: Chunk, state: ForwardState):
        """The chunk's residual input (streams, layer 0's `pre`); sets the chunk's image mask
        and Engram rows on `state`."""
        ids, embeddings, images = chunk
        state.image_mask = None if images is None else images.mask()
        state.engram_rows = self.hash_engram(ids, state.image_mask)
        x = self.text.embed_tokens(ids) if embeddings is None else embeddings.astype(mx.bfloat16)
        if images is not None:  # rows made for every span position hold the delimiters too
            x = images.merge(x, {} if images.has_delimiter_rows else delimiters(self.model))
        return self.text.residual_input(x)

    def hash_engram(self, ids: mx.array, image_mask: Optional[mx.array]):
        """The chunk's Engram rows (`engram.engram_rows`; None without Engram layers)."""
        return engram_rows(self.model.engram_hasher, self.model.cfg.engram_layer_ids, ids,
                           self.cache, image_mask)

    def write_draft_rings(self, taps: dict, end: int) -> None:
        """The drafter's rings from the call's target-layer `taps` (`write_draft_rings`)."""
        write_draft_rings(self.model, self.cache, taps, end)

    def next_chunk(self) -> Chunk:
        """The next chunk: `step_size` rows, or in a paced call as many as the allowance."""
        rows = self.rows
        if self.pace is None:
            return rows.take()
        return rows.take(max(1, int(min(self.pace.allowance, rows.step, rows.left))))

    def pause(self, done: float, next_work: float):
        """Between two pieces: a plain call yields; a paced one records the piece's work and
        the next piece's, and takes the next allowance."""
        if self.pace is None:
            yield
            return
        pace = self.pace
        pace.done, pace.left, pace.next = done, pace.left - done, next_work
        pace.allowance = yield

    def chunk_work(self) -> float:
        return min(self.rows.step, self.rows.left)

    def full(self, last_only: bool):
        """Every layer over every row, chunk by chunk (a generator: it yields between chunks
        and returns the logits)."""
        outs, position = [], self.start
        if self.pace is not None:
            self.pace.left = self.rows.length
            yield from self.pause(0.0, self.chunk_work())
        while self.rows.left:
            chunk = self.next_chunk()
            state, streams, pre = self.encode(chunk, position)
            hidden = self.text.decoder_stack(streams, pre, state, self.cache)
            outs.append(self.report(self.model.head(hidden, last_only), chunk.ids.shape[1]))
            position = state.end
            if self.rows.left:
                yield from self.pause(chunk.ids.shape[1], self.chunk_work())
        return outs[-1] if last_only else mx.concatenate(outs, axis=1)

    def encoder_only(self, mode: str):
        """Encoder (and the first decoder layer's global KV) chunk by chunk, then the decoder
        over the halo rows of the whole call (a generator: it yields after each chunk and
        returns the last position's logits; a paced call yields between halo pieces too)."""
        text, position = self.text, self.start
        end = self.start + self.rows.length
        halo = halo_spans(self.model, end - self.start, mode)
        keep = halo[0][0] if halo else 1
        works = [rows_in / max(text.decoder_start, 1) for rows_in, _ in halo]
        if self.pace is not None:
            self.pace.left = self.rows.length + sum(works)
            yield from self.pause(0.0, self.chunk_work())
        tail = None  # (streams, pre) of the last `keep` rows so far: memory bounded by the halo
        while self.rows.left:
            chunk = self.next_chunk()
            state, streams, pre = self.encode(chunk, position)
            self.precompress(state, streams, pre)
            streams, pre = streams[:, -keep:], pre[:, -keep:]
            if tail is not None:
                streams = mx.concatenate([tail[0], streams], axis=1)[:, -keep:]
                pre = mx.concatenate([tail[1], pre], axis=1)[:, -keep:]
            tail = self.report((streams, pre), chunk.ids.shape[1])
            position = state.end
            if not self.rows.left and self.pace is not None:
                self.pace.in_halo = True
            yield from self.pause(chunk.ids.shape[1],
                                  self.chunk_work() if self.rows.left else sum(works[:1]))
        state = self.state(self.start, end)
        state.image_mask = self.image_mask
        state.precompressed.add(text.decoder_start)
        state.truncate_window = mode == "ced_replay" and end - self.start > text.cfg.sliding_window
        hidden = yield from self.decode_halo(tail, state, halo, works)
        return self.model.head(hidden, True)

    def decode_halo(self, tail: tuple, state: ForwardState, halo: list, works: list):
        """The decoder over the halo (a generator returning the normed hidden rows): in one
        pass, or in a paced call as groups of decoder layers that fit each allowance (at
        least one), the carry evaluated between them (the same ops, so the same bits)."""
        if self.pace is None:
            return self.text.decoder_stack(*tail, state, self.cache, halo)
        carry, first = (*tail, None), 0
        while first < len(works):
            stop, work = first + 1, works[first]
            while stop < len(works) and work + works[stop] <= self.pace.allowance:
                work, stop = work + works[stop], stop + 1
            carry = self.text.decoder_layers(carry, state, self.cache, halo, first, stop)
            first = stop
            if first < len(works):
                carry = self.report(carry, 0)
                yield from self.pause(work, works[first])
        return self.text.decoder_output(carry)

    def precompress(self, state: ForwardState, streams, pre) -> None:
        """CED step 2: the first decoder layer's compressed KV for every row of the chunk (its
        compressor reads the encoder's output); the halo pass then skips it."""
        first = self.text.decoder_start
        if first < len(self.text.layers) and self.text.layers[first].role.mode == FULL:
            layer = self.text.layers[first]
            layer.self_attn.compress(layer.attention_input(streams, pre), state)


def halo_spans(model, rows: int, mode: str) -> Optional[list]:
    """Rows each decoder layer reads and computes: exact CED (`ced_halo`, extended for a trim
    of `ced_rollback` tokens), the bounded replay (the last window), or None (every row)."""
    if mode == "full":
        return None
    cfg = model.cfg
    if mode == "ced_replay":
        span = min(rows, cfg.sliding_window)
        return [(span, span)] * (cfg.num_hidden_layers - model.model.decoder_start)
    rollback = model.ced_rollback
    if model.drafting:  # the taps at the last layers must fill the draft rings' window too
        rollback = max(rollback, 1) + 1
    return ced_halo(cfg, rows, rollback)


def _as_ids(ids) -> mx.array:
    ids = ids if isinstance(ids, mx.array) else mx.array(ids)
    ids = ids[None] if ids.ndim == 1 else ids
    if ids.ndim != 2:
        raise ValueError(f"ids must be [batch, length] token ids, got shape {list(ids.shape)}")
    return ids.astype(mx.int32)


def check_images(model, ids, embeddings, images) -> None:
    """A clear ValueError for image inputs that do not fit the call."""
    from .vision.prompt import VISION_MISSING

    if images is None:
        return
    if "vision" not in model and not images.has_delimiter_rows:
        raise ValueError(f"the call has image spans but {VISION_MISSING}")
    if embeddings is not None:
        raise ValueError("give either input_embeddings or images, not both")
    if ids.shape[0] != 1:
        raise ValueError(f"image prompts run with batch 1 (as the reference), got batch "
                         f"{ids.shape[0]}")
    if images.token_types.shape != (ids.shape[1],):
        raise ValueError(f"images.token_types has shape {list(images.token_types.shape)}, "
                         f"the ids have {ids.shape[1]} positions")
    want = [images.n_image_rows, model.cfg.hidden_size]
    if list(images.rows.shape) != want:
        raise ValueError(f"images.rows must have shape {want} (one row per IMAGE position, or "
                         f"per span position with has_delimiter_rows; hidden_size), got "
                         f"{list(images.rows.shape)}")


def _check_inputs(model, ids, cache, embeddings, step_size, teacher) -> None:
    """A clear ValueError for input a forward cannot run (nothing has changed yet)."""
    batch, length = ids.shape
    if length == 0:
        raise ValueError(f"ids are empty (shape {list(ids.shape)}): a forward needs at least "
                         "one token")
    held = {c.batch for c in cache} - {None}
    if held and held != {batch}:
        raise ValueError(f"ids have batch {batch} but the cache holds batch {held.pop()}")
    end = cache[0].offset + length
    if end > model.cfg.max_position_embeddings:
        raise ValueError(f"positions up to {end - 1} exceed max_position_embeddings "
                         f"{model.cfg.max_position_embeddings}")
    if step_size is not None and not (isinstance(step_size, int) and step_size > 0):
        raise ValueError(f"step_size must be a positive int, got {step_size!r}")
    if length > 1:  # prompts only: a decode step's token is not forced to the host for this
        low, high = mx.min(ids).item(), mx.max(ids).item()
        if low < 0 or high >= model.cfg.vocab_size:
            raise ValueError(f"token ids must lie in [0, {model.cfg.vocab_size}), got ids from "
                             f"{low} to {high}")
    want = [batch, length, model.cfg.hidden_size]
    if embeddings is not None and list(embeddings.shape) != want:
        raise ValueError(f"input_embeddings must have shape {want} (ids' batch and length, "
                         f"hidden_size), got {list(embeddings.shape)}")
    if teacher is not None and step_size is not None and step_size < length:
        raise ValueError("a teacher-forced forward runs in one chunk (step_size=None)")
