"""Grammar-constrained decoding: an mlx-lm logits processor that lets through only the tokens a
grammar allows next (llguidance computes the mask from the grammar and the tokenizer, special
tokens included), with an optional free reasoning phase before it.

The processor is a function of the tokens it is shown: it keeps a matcher in step with the
reply (consuming new tokens, rolling back ones that were taken back), so the same processor
serves plain decoding, a batch (one processor per sequence) and speculative decoding, whose
verify rows show it a draft token by token and then only the accepted ones. The grammar's end
is the decoding loop's stop tokens (llguidance's EOS set to them), so a finished grammar lets
through exactly the tokens that end the reply. A row that follows a token the grammar refuses
(a rejected draft's successors, never used: the draft is refused by the mask of the row
before it) lets through the stop tokens alone, so nothing unconstrained can follow.
"""

from __future__ import annotations

import time
import weakref
from typing import Optional, Sequence

import llguidance.hf
import mlx.core as mx
import numpy as np
from llguidance import LLMatcher
from transformers import PreTrainedTokenizerFast

_LL_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class GrammarError(ValueError):
    """A grammar (or JSON schema) the library cannot compile; the message is the library's."""


def grammar_tokenizer(tokenizer, stop_tokens: Sequence[int] = ()):
    """llguidance's view of a tokenizer (mlx-lm's TokenizerWrapper or a fast Hugging Face
    tokenizer) whose EOS, the grammar's end, is `stop_tokens` (default: the wrapper's
    `eos_token_ids`, else the Hugging Face eos); made once per tokenizer and stop set (it
    takes about a second for a 128k vocabulary)."""
    # a wrapper holds the Hugging Face tokenizer in `_tokenizer`; that one's `_tokenizer` is
    # the Rust backend, which llguidance does not take
    hf = tokenizer if isinstance(tokenizer, PreTrainedTokenizerFast) else tokenizer._tokenizer
    # a finished grammar lets through every token the loop stops on, not the Hugging Face
    # eos alone: the chat format's EOS, which the next turn renders after the reply, may be
    # another token
    stops = list(stop_tokens) or _stop_ids(tokenizer) or [hf.eos_token_id]
    key = tuple(sorted({int(t) for t in stops if t is not None}))
    made = _LL_TOKENIZERS.setdefault(hf, {})
    if key not in made:
        made[key] = llguidance.hf.from_tokenizer(hf, eos_token=list(key) or None)
    return made[key]


def _stop_ids(tokenizer) -> list:
    """mlx-lm's wrapper's `eos_token_ids` (a Hugging Face tokenizer's attribute of that name
    may be a single id)."""
    ids = getattr(tokenizer, "eos_token_ids", None)
    return [ids] if isinstance(ids, int) else list(ids or ())


def check_grammar(grammar: str, tokenizer) -> None:
    """Raise GrammarError unless `grammar` (llguidance's Lark or JSON form) compiles."""
    error = LLMatcher.validate_grammar(grammar, grammar_tokenizer(tokenizer))
    if error:
        raise GrammarError(error.splitlines()[0] if error.strip() else error)


class Constraint:
    """A grammar for one tokenizer; `processor()` makes one sequence's logits processor.

    Args:
        grammar: llguidance's Lark text (or a JSON grammar, e.g. `grammar_from_json_schema`),
            or None for no grammar (only the reasoning rules below).
        tokenizer: the model's tokenizer.
        think_end: with thinking, the id of `</think>`: the reply starts with free reasoning
            (in which the stop tokens are banned, so that an answer follows) and the grammar
            applies after the first `think_end`.
        reasoning_budget: most reasoning tokens; the next one is then `think_end`.
        stop_tokens: the ids that end a reply (banned while reasoning).
    """

    def __init__(self, grammar: Optional[str], tokenizer, *, think_end: Optional[int] = None,
                 reasoning_budget: Optional[int] = None, stop_tokens: Sequence[int] = ()):
        if grammar is not None:
            check_grammar(grammar, tokenizer)
            self.ll_tokenizer = grammar_tokenizer(tokenizer, stop_tokens)
        self.grammar, self.think_end = grammar, think_end
        self.reasoning_budget, self.stop_tokens = reasoning_budget, list(stop_tokens)

    def processor(self) -> "GrammarProcessor":
        return GrammarProcessor(self)


class GrammarProcessor:
    """`processor(history, logits) -> logits` for one sequence (mlx-lm's processor signature):
    `history` [N] is the prompt and the reply so far; its first call sees the prompt alone,
    which fixes where the reply starts."""

    def __init__(self, constraint: Constraint):
        self.constraint, self.start, self.fed = constraint, None, []
        self.matcher = None if constraint.grammar is None else \
            LLMatcher(constraint.ll_tokenizer, constraint.grammar, log_level=0)
        self.masks = 0  # grammar masks computed (for the cost benchmark)
        self.mask_seconds = 0.0  # spent computing them (the server's metrics)

    def __call__(self, history: mx.array, logits: mx.array) -> mx.array:
        if self.start is None:
            self.start = history.shape[0]
        reply = history[self.start:].tolist() if history.shape[0] > self.start else []
        c = self.constraint
        if c.think_end is not None and c.think_end not in reply:
            return self._reasoning(len(reply), logits)
        answer = reply[reply.index(c.think_end) + 1:] if c.think_end is not None else reply
        if self.matcher is None:
            return logits
        if not self._follow(answer):
            return self._only(c.stop_tokens, logits)
        return self._mask(logits)

    @staticmethod
    def _only(tokens: Sequence[int], logits: mx.array) -> mx.array:
        """`logits` with every token but `tokens` banned (unchanged when there are none)."""
        if not tokens:
            return logits
        vocab = mx.arange(logits.shape[-1])
        return mx.where(mx.any(vocab[:, None] == mx.array(list(tokens)), axis=1), logits,
                        -mx.inf)

    def _reasoning(self, done: int, logits: mx.array) -> mx.array:
        c, vocab = self.constraint, mx.arange(logits.shape[-1])
        if c.reasoning_budget is not None and done >= c.reasoning_budget:
            return mx.where(vocab == c.think_end, logits, -mx.inf)
        if not c.stop_tokens:
            return logits
        banned = mx.zeros(logits.shape[-1], mx.bool_)
        for token in c.stop_tokens:
            banned = banned | (vocab == token)
        return mx.where(banned, -mx.inf, logits)

    def _follow(self, answer: list) -> bool:
        """Bring the matcher to `answer`; False when the grammar refuses one of its tokens."""
        same = min(len(answer), len(self.fed))
        if answer[:same] != self.fed[:same]:  # whole-list compares run in C: one per token
            same = next(i for i, (a, b) in enumerate(zip(answer, self.fed)) if a != b)
        if same < len(self.fed):
            self.matcher.rollback(len(self.fed) - same)
            del self.fed[same:]
        new = answer[same:]
        taken = self.matcher.try_consume_tokens(new) if new else 0
        self.fed += new[:taken]
        return taken == len(new)

    def _mask(self, logits: mx.array) -> mx.array:
        self.masks += 1
        tic = time.perf_counter()
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), np.uint8),
                             bitorder="little")
        vocab = logits.shape[-1]
        allowed = np.zeros(vocab, bool)
        n = min(vocab, self.constraint.ll_tokenizer.vocab_size)
        allowed[:n] = bits[:n]
        self.mask_seconds += time.perf_counter() - tic
        if not allowed.any():  # a matcher in error allows nothing: end the reply
            return self._only(self.constraint.stop_tokens, logits)
        return mx.where(mx.array(allowed), logits, -mx.inf)
