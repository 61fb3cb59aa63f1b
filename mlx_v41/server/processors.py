"""Logits processors a request asks for: OpenAI's penalties and `logit_bias` (mlx-lm's
`make_logits_processors`), and the mask that keeps `tool_choice: "none"` from opening a DSML
tool-call block.
"""

from __future__ import annotations

import mlx.core as mx

from ..chat import format as cf
from ..generation.constrained import Constraint
from .errors import RequestError


def processor_fields(body, vocab: int, allow_calls: bool) -> dict:
    """What an OpenAI request's processors are made of, as JSON values (shared with other
    ranks)."""
    bias = _logit_bias(body.logit_bias, vocab)
    return base_fields(allow_calls, logit_bias=None if bias is None else
                       [[k, v] for k, v in bias.items()],
                       repetition_penalty=body.repetition_penalty,
                       presence_penalty=body.presence_penalty or None,
                       frequency_penalty=body.frequency_penalty or None)


def base_fields(allow_calls: bool, constraint=None, **penalties) -> dict:
    """Processor fields with no bias or penalty unless given (`logit_bias`,
    `repetition_penalty`, `presence_penalty`, `frequency_penalty`); `constraint`: what
    `constraints.constraint_fields` returned."""
    fields = {"logit_bias": None, "repetition_penalty": None, "presence_penalty": None,
              "frequency_penalty": None, "allow_calls": allow_calls, "constraint": constraint}
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
    dsml = tokenizer.convert_tokens_to_ids(cf.DSML)
    if not fields["allow_calls"] and isinstance(dsml, int):
        processors.append(ban_token(dsml))
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


def ban_token(token: int):
    """A processor that gives `token` no probability."""
    def processor(tokens, logits):
        banned = mx.arange(logits.shape[-1]) == token
        return mx.where(banned, -mx.inf, logits)
    return processor
