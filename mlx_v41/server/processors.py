"""Logits processors a request asks for: OpenAI's penalties and `logit_bias` (mlx-lm's
`make_logits_processors`), the mask of the tokens a reply never holds (the chat format's
special tokens that only a prompt places, and the DSML token under `tool_choice: "none"`), and
the grammar of a constrained reply.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..chat import format as cf
from ..generation.constrained import Constraint
from .errors import RequestError


def processor_fields(body, vocab: int, allow_calls: bool, chat: bool = True) -> dict:
    """What an OpenAI request's processors are made of, as JSON values (shared with other
    ranks); `chat`: a chat reply (not a raw completion)."""
    bias = _logit_bias(body.logit_bias, vocab)
    return base_fields(allow_calls, chat=chat, logit_bias=None if bias is None else
                       [[k, v] for k, v in bias.items()],
                       repetition_penalty=body.repetition_penalty,
                       presence_penalty=body.presence_penalty or None,
                       frequency_penalty=body.frequency_penalty or None)


def base_fields(allow_calls: bool, constraint=None, chat: bool = True, **penalties) -> dict:
    """Processor fields with no bias or penalty unless given (`logit_bias`,
    `repetition_penalty`, `presence_penalty`, `frequency_penalty`); `constraint`: what
    `constraints.constraint_fields` returned; `chat`: a chat reply, whose special tokens are
    masked (`reply_bans`)."""
    fields = {"logit_bias": None, "repetition_penalty": None, "presence_penalty": None,
              "frequency_penalty": None, "allow_calls": allow_calls, "constraint": constraint,
              "chat": chat}
    fields.update(penalties)
    return fields


def processors_from(fields: dict, tokenizer) -> list:
    from mlx_lm.sample_utils import make_logits_processors

    bias = fields["logit_bias"]
    processors = make_logits_processors(
        logit_bias=None if bias is None else {int(k): v for k, v in bias},
        repetition_penalty=fields["repetition_penalty"],
        presence_penalty=fields["presence_penalty"],
        frequency_penalty=fields["frequency_penalty"])
    chat = fields.get("chat", True)
    banned = reply_bans(tokenizer, fields["allow_calls"], chat)
    hf = _hugging_face(tokenizer)
    # a padded embedding's rows past the vocabulary decode to nothing
    rows = len(hf) if chat and hf is not None else None
    if banned or rows is not None:
        processors.append(ban_tokens(banned, rows))
    constrained = _constraint(fields, tokenizer)
    if constrained is not None:
        processors.append(constrained)
    return processors


def _constraint(fields: dict, tokenizer):
    """The grammar (and reasoning budget) processor of `fields`' constraint, or of a bare
    `reasoning_budget` (Anthropic's thinking budget), or None."""
    constraint, budget = fields.get("constraint"), fields.get("reasoning_budget")
    if constraint is None and budget is None:
        return None
    grammar, thinking = None, True
    if constraint is not None:
        grammar, thinking = constraint["grammar"], constraint["thinking"]
        budget = constraint["reasoning_budget"] if budget is None else budget
    think_end = tokenizer.convert_tokens_to_ids(cf.THINK_END) if thinking else None
    if thinking and not isinstance(think_end, int):
        return None  # no reasoning phase without the token (raw-prompt tokenizers)
    return Constraint(grammar, tokenizer, think_end=think_end, reasoning_budget=budget,
                      stop_tokens=tokenizer.eos_token_ids).processor()


def _logit_bias(bias, vocab: int):
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        if not (key.isdigit() and int(key) < vocab):
            raise RequestError(f"logit_bias key {key!r} is not a token id in 0..{vocab - 1}",
                               param="logit_bias")
        out[int(key)] = value
    return out


_BANS: dict = {}  # (id of the tokenizer, allow_calls, chat) -> (the tokenizer, its bans)


def reply_bans(tokenizer, allow_calls: bool, chat: bool = True) -> tuple:
    """Token ids a reply never holds, sorted (worked out once per tokenizer). A chat reply:
    every special token of the vocabulary (BOS, `<｜User｜>`, the image placeholder, ...:
    markers only a prompt places, which would come back in the next turn's prompt as markers)
    but the stop tokens, `</think>` and, when calls are allowed, the DSML token. A raw
    completion: the DSML token without calls, nothing else (its prompt and text are the
    client's own format)."""
    key = (id(tokenizer), allow_calls, chat)
    if key not in _BANS:  # the tokenizer is kept with its entry, so its id stays its own
        _BANS[key] = (tokenizer, _bans(tokenizer, allow_calls, chat))
    return _BANS[key][1]


def _bans(tokenizer, allow_calls: bool, chat: bool) -> tuple:
    stops = getattr(tokenizer, "eos_token_ids", None)
    keep = {stops} if isinstance(stops, int) else set(stops or ())
    keep |= {_token_id(tokenizer, cf.THINK_END)} | ({_token_id(tokenizer, cf.DSML)}
                                                    if allow_calls else set())
    names = ([] if allow_calls else [cf.DSML]) + (list(cf.SPECIAL_TOKEN_IDS) if chat else [])
    banned = {_token_id(tokenizer, name) for name in names}
    hf = _hugging_face(tokenizer)
    if chat and hf is not None:
        banned |= {i for i, t in hf.added_tokens_decoder.items() if t.special}
    return tuple(sorted(t for t in banned - keep if t is not None))


def _token_id(tokenizer, name: str):
    """The id of a single-token `name`, or None where the vocabulary lacks it (an unknown
    token may map to the unknown token's id)."""
    token = tokenizer.convert_tokens_to_ids(name)
    if not isinstance(token, int) or token < 0:
        return None
    back = getattr(tokenizer, "convert_ids_to_tokens", None)
    return token if back is None or back(token) == name else None


def _hugging_face(tokenizer):
    """The Hugging Face tokenizer inside mlx-lm's wrapper (None for a stand-in)."""
    hf = getattr(tokenizer, "_tokenizer", None)
    return hf if hasattr(hf, "added_tokens_decoder") else None


def ban_tokens(tokens, rows=None):
    """A processor that gives `tokens` (and, given `rows`, every id from `rows` on) no
    probability; its mask is made once per logits width."""
    masks = {}

    def processor(history, logits):
        width = logits.shape[-1]
        if width not in masks:
            banned = np.zeros(width, bool)
            banned[[t for t in tokens if t < width]] = True
            banned[width if rows is None else rows:] = True
            masks[width] = mx.array(banned)
        return mx.where(masks[width], mx.array(-mx.inf, logits.dtype), logits)
    return processor
