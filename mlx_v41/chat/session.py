"""`ChatSession`: a multi-turn conversation over one model that keeps its prompt cache across
turns. Each turn renders the whole conversation with the V4.1 chat format and runs only the
tokens the cache does not hold yet. In thinking mode earlier turns lose their reasoning (and the
header token changes), so the new prompt need not extend the cached tokens: the session then
rolls the cache back with `trim_cache`, or restores the snapshot taken at the end of the last
prompt, or prefills from scratch, whichever keeps the most.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

from . import format as cf
from .completion import parse_completion
from ..cache.layer import CacheError, cache_bytes
from ..generation.api import (DEFAULT_PREFILL_STEP_SIZE, GenerationResponse, check_context,
                              prefill, stream_decode, wired_limit)
from ..generation.prompt_reuse import (PromptCache, read_prompt_cache, reuse_prompt_cache,
                                       write_prompt_cache)
from ..generation.api import PrefillProgress
from ..generation.group import ONE_PROCESS, ProcessGroup
from ..generation.speculative import MAX_DRAFT_TOKENS, DraftStats, check_draft_settings
from ..model.vision.preprocess import image_reference, load_image
from ..model.vision.prompt import VISION_MISSING, ImagePrompt, has_vision


DEFAULT_MAX_TOKENS = 256  # mlx-lm chat's default
SESSION_FORMAT = "mlx_v41.chat_session.v1"


CACHE_SOURCES = ("reply", "prompt snapshot")  # the candidates a turn may continue, in order


@dataclass
class TurnStats:
    """What one turn cost: the rendered prompt, how much of it the cache already held, and the
    generation (rates in tokens/s, memory in GB)."""

    prompt_tokens: int
    reused_tokens: int
    prefilled_tokens: int
    prompt_tps: float
    source: str  # where the reused tokens came from: "reply", "prompt snapshot" or "none"
    generation_tokens: int = 0
    generation_tps: float = 0.0
    peak_memory: float = 0.0
    finish_reason: Optional[str] = None
    drafts: Optional[DraftStats] = None  # with speculative decoding: the reply's drafts


@dataclass
class _Reply:
    """A reply in progress: its text, token ids and last response."""

    text: str = ""
    tokens: list = field(default_factory=list)
    last: Optional[GenerationResponse] = None


def assistant_message(text: str, thinking: bool, is_finished: bool) -> dict:
    """The transcript entry for a generated reply (reasoning, answer, tool calls)."""
    try:
        parsed = parse_completion(text + (cf.EOS if is_finished else ""),
                                  "thinking" if thinking else "chat")
        reasoning, content = parsed["reasoning_content"], parsed["content"]
        calls = parsed["tool_calls"]
    except ValueError:  # a reply the parser rejects (e.g. special tokens inside): keep it raw
        reasoning, found, content = text.partition(cf.THINK_END) if thinking else ("", "", text)
        reasoning, content = (reasoning, content) if found or not thinking else (text, "")
        calls = []
    # The renderer rejects an image placeholder outside user content; none has an image here.
    message = {"role": "assistant", "content": content.replace(cf.IMAGE_PLACEHOLDER, "")}
    if reasoning:
        message["reasoning_content"] = reasoning.replace(cf.IMAGE_PLACEHOLDER, "")
    if calls:
        message["tool_calls"] = calls
    return message


class ChatSession:
    """A conversation with a model and the prompt caches that make its turns cheap.

    `live` holds the cache after the last reply (prompt + reply tokens), `snapshot` the cache at
    the end of the last prompt; both are candidates for the next turn's prefix. `draft`,
    `num_draft_tokens` and `draft_confidence` are `stream_generate`'s (draft="dspark" decodes
    speculatively: the model loaded with dspark=True, `sampler` None or `mlx_v41.Sampling`);
    they may change between turns. `group`: the processes running the model
    (`generation.group`; a group model's ranks pass `model.group`).
    """

    def __init__(self, model, tokenizer, *, system_prompt: Optional[str] = None,
                 thinking: bool = True, reasoning_effort=None,
                 max_tokens: int = DEFAULT_MAX_TOKENS, sampler=None,
                 prefill_step_size: Optional[int] = DEFAULT_PREFILL_STEP_SIZE,
                 show_progress: bool = False, draft: Optional[str] = None,
                 num_draft_tokens: int = MAX_DRAFT_TOKENS,
                 draft_confidence: Optional[float] = None,
                 group: ProcessGroup = ONE_PROCESS):
        self.model, self.tokenizer, self.group = model, tokenizer, group
        self.system_prompt, self.thinking = system_prompt, thinking
        self.reasoning_effort, self.max_tokens = reasoning_effort, max_tokens
        self.sampler, self.prefill_step_size = sampler, prefill_step_size
        self.show_progress = show_progress  # a progress line on stderr for long prefills
        self.draft, self.num_draft_tokens = draft, num_draft_tokens
        self.draft_confidence = draft_confidence
        self.reset()

    def reset(self) -> None:
        self.messages: list = []
        self.live: Optional[PromptCache] = None
        self.snapshot: Optional[PromptCache] = None
        self.stats: Optional[TurnStats] = None
        self._reply: Optional[_Reply] = None  # the reply in progress
        self.attached: list = []  # images for the next user message (`attach`)

    def attach(self, image) -> None:
        """Queue an image (path, URL, data URI, bytes or PIL image) for the next user message;
        ValueError (nothing queued) when the model has no vision tower or it cannot be read."""
        if not has_vision(self.model):
            raise ValueError(f"cannot attach an image: {VISION_MISSING}")
        load_image(image)
        self.attached.append(image_reference(image))

    def conversation(self) -> list:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + self.messages

    def prompt_tokens(self) -> list:
        """The rendered conversation (ending in the generation header) as token ids, each
        image expanded into its span."""
        return self.prompt().ids

    def prompt(self) -> ImagePrompt:
        """The rendered conversation with its images (read from their blocks)."""
        conversation = self.conversation()
        ids = self.tokenizer.encode_chat(conversation, self.thinking, self.reasoning_effort)
        return self.prepare(ids, cf.collect_images(conversation))

    def prepare(self, ids: list, images: list) -> ImagePrompt:
        """The placeholders of `ids` expanded with `images` (a session across ranks shares
        rank 0's)."""
        return self.group.prepare_prompt(self.model, ids, images)

    def reply(self, text: str, images: Sequence = ()) -> Iterator[GenerationResponse]:
        """Add a user message (after the attached images and `images`: paths, URLs, data URIs,
        bytes or PIL images) and stream the reply. If the caller stops early (Ctrl-C), call
        `interrupt()` so the transcript and caches stay consistent."""
        if self.draft:  # refused before the turn starts, so the session stays as it was
            check_draft_settings(self.model, self.sampler, self.num_draft_tokens)
        blocks = [{"type": "image", "image": image}
                  for image in self.attached + [image_reference(i) for i in images]]
        self.messages.append({"role": "user", "content": blocks + [
            {"type": "text", "text": text}] if blocks else text})
        self._reply = None
        try:
            prompt = self.prompt()
            check_context(self.model, 0, len(prompt.ids))
        except ValueError:
            self.messages.pop()
            raise
        self.attached = []
        with wired_limit(self.model):
            yield from self._run(prompt)

    def _run(self, prompt: ImagePrompt) -> Iterator[GenerationResponse]:
        tokens, records = prompt.ids, prompt.records()
        state, source = reuse_prompt_cache(self.model, tokens, [self.live, self.snapshot],
                                           records)
        reused, todo = len(state.tokens), tokens[len(state.tokens):]
        progress = PrefillProgress(self.prefill_step_size) if self.show_progress else None
        tic = time.perf_counter()
        logits = prefill(self.model, todo, state.cache, self.prefill_step_size, progress,
                         prompt.inputs(self.model, reused), self.group)
        seconds = time.perf_counter() - tic
        state.tokens.extend(todo)
        state.images = records
        self.live, self.snapshot = None, state.copy()
        self.stats = TurnStats(len(tokens), reused, len(todo), len(todo) / max(seconds, 1e-9),
                               "none" if source is None else CACHE_SOURCES[source])
        reply = self._reply = _Reply()
        for response in stream_decode(self.model, self.tokenizer, logits, state.cache,
                                      prompt_tokens=len(todo), prompt_seconds=seconds,
                                      max_tokens=self.max_tokens, sampler=self.sampler,
                                      history=todo, draft=self.draft,
                                      num_draft_tokens=self.num_draft_tokens,
                                      draft_confidence=self.draft_confidence,
                                      group=self.group):
            reply.text += response.text
            reply.tokens.append(response.token)
            reply.last = response
            yield response
        state.tokens.extend(reply.tokens)  # stream_decode feeds every token it yields
        self.live = state
        self._finish(reply.last.finish_reason if reply.last else "length")

    def _finish(self, reason: Optional[str]) -> None:
        """Record the reply (its text so far) in the transcript and the turn's stats."""
        reply, self._reply = self._reply, None
        self.messages.append(assistant_message(reply.text, self.thinking, reason == "stop"))
        if reply.last is not None:
            self.stats.generation_tokens = reply.last.generation_tokens
            self.stats.generation_tps = reply.last.generation_tps
            self.stats.peak_memory = reply.last.peak_memory
            self.stats.drafts = reply.last.draft_stats
        self.stats.finish_reason = reason

    def interrupt(self) -> None:
        """After a reply was stopped: keep what was generated (the live cache was dropped when
        the reply started; the prompt snapshot stays). Stopped before the reply started: the
        user message is withdrawn and the caches are as they were."""
        if self._reply is None:
            if self.messages and self.messages[-1]["role"] == "user":
                self.messages.pop()
            return
        self._finish("interrupted")

    def save(self, path) -> None:
        """The session (cache of the last reply, or of the last prompt, and the transcript) as
        one prompt-cache file."""
        state = self.live or self.snapshot or PromptCache(self.model.make_cache())
        write_prompt_cache(path, state.cache, self.model, {
            "format": SESSION_FORMAT, "messages": json.dumps(self.messages),
            **state.metadata(), "system_prompt": json.dumps(self.system_prompt),
            "thinking": json.dumps(self.thinking),
            "reasoning_effort": json.dumps(self.reasoning_effort)}, self.group)

    def load(self, path) -> None:
        """Replace this session by a saved one (same config, weights and prefill mode;
        CacheError naming the difference otherwise)."""
        cache, meta = read_prompt_cache(path, self.model, self.group)
        if meta.get("format") != SESSION_FORMAT:
            raise CacheError(f"{path}: a prompt cache, but not a saved chat session")
        self.reset()
        self.messages = json.loads(meta["messages"])
        self.live = PromptCache.from_metadata(cache, meta)
        self.system_prompt = json.loads(meta["system_prompt"])
        self.thinking = json.loads(meta["thinking"])
        self.reasoning_effort = json.loads(meta["reasoning_effort"])


def format_stats(session: ChatSession) -> str:
    s, lines = session.stats, []
    if s is not None:
        lines += [f"prompt: {s.prompt_tokens} tokens, {s.reused_tokens} reused from the cache "
                  f"({s.source}), {s.prefilled_tokens} prefilled at "
                  f"{s.prompt_tps:.1f} tokens/s",
                  f"reply: {s.generation_tokens} tokens at {s.generation_tps:.1f} tokens/s "
                  f"({s.finish_reason})",
                  f"peak memory: {s.peak_memory:.3f} GB"]
        if s.drafts is not None:
            lines.insert(2, f"drafts: {s.drafts.accepted} accepted of {s.drafts.proposed} "
                            f"proposed, {s.drafts.tokens_per_cycle:.2f} tokens per verify cycle")
    state = session.live or session.snapshot
    limit = session.model.args.text_config.max_position_embeddings
    if state is not None:
        size = cache_bytes(state.cache)["total"]
        lines.append(f"cache: {len(state.tokens)} of {limit} positions, {size / 2**20:.2f} MiB")
    store = getattr(session.model, "expert_store", None)
    if store is not None:
        lines.append(f"experts (since loading): {store.stats.summary()}")
    dspark = f"dspark: {'on' if session.draft else 'off'}; " if session.model.drafting else ""
    lines.append(f"thinking: {'on' if session.thinking else 'off'}; {dspark}"
                 f"{len(session.messages)} messages")
    return "\n".join(lines)
