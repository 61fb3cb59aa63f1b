"""Response bodies in OpenAI's shapes: chat completion messages and stream chunks (reasoning
as `reasoning_content` and `reasoning`, tool calls with ids), completions, usage, logprobs,
errors.
"""

from __future__ import annotations

import json
import math
import time
from typing import Optional

from ..engine import Finish
from ..reply_parser import Delta, Reply
from ..serving import new_id


def sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage(finish: Finish) -> dict:
    return {"prompt_tokens": finish.prompt_tokens, "completion_tokens": finish.completion_tokens,
            "total_tokens": finish.prompt_tokens + finish.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": finish.cached_tokens}}


def sum_usage(usages: list) -> dict:
    """The usage of a request with several choices: the prompt once, completions summed."""
    first = usages[0]
    completion = sum(u["completion_tokens"] for u in usages)
    return dict(first, completion_tokens=completion,
                total_tokens=first["prompt_tokens"] + completion)


def finish_reason(finish: Finish, has_calls: bool = False) -> str:
    if finish.reason == "stop" and has_calls:
        return "tool_calls"
    return finish.reason


# OpenAI's stand-in for a log-probability of minus infinity, which JSON cannot carry
LEAST_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LEAST_LOGPROB


def _possible(top) -> list:
    """The alternatives a mask left possible (a constraint or a ban gives the others -inf)."""
    return [(token, logprob) for token, logprob in top if math.isfinite(logprob)]


class TokenText:
    """Token ids as the text and bytes OpenAI's logprobs report: the alternatives a mask
    ruled out are left out, and a logprob JSON cannot carry is `LEAST_LOGPROB`."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.table = getattr(tokenizer.detokenizer, "token_bytes", None)

    def bytes(self, token: int) -> bytes:
        if self.table is not None and token < len(self.table):
            return self.table[token]
        return self.tokenizer.decode([token]).encode()

    def entry(self, token: int, logprob: float) -> dict:
        raw = self.bytes(token)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": _finite(logprob),
                "bytes": list(raw)}

    def chat_logprobs(self, tokens: list) -> Optional[dict]:
        """`choices[].logprobs` of a chat completion for these `Token`s (None without)."""
        content = [dict(self.entry(t.token, t.logprob),
                        top_logprobs=[self.entry(i, lp) for i, lp in _possible(t.top)])
                   for t in tokens if t.logprob is not None]
        return {"content": content, "refusal": None} if content else None

    def completion_logprobs(self, tokens: list, offset: int) -> Optional[dict]:
        """The legacy completions shape; `offset`: characters of text before these tokens."""
        kept = [t for t in tokens if t.logprob is not None]
        if not kept:
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t in kept:
            out["tokens"].append(self.entry(t.token, t.logprob)["token"])
            out["token_logprobs"].append(_finite(t.logprob))
            out["top_logprobs"].append({self.entry(i, lp)["token"]: lp
                                        for i, lp in _possible(t.top)})
            out["text_offset"].append(offset)
            offset += len(t.text)
        return out


class ChatStream:
    """Builds the chunks of one streamed chat completion."""

    def __init__(self, model_id: str, token_text: TokenText, index: int = 0):
        self.id, self.created, self.model = new_id("chatcmpl-"), int(time.time()), model_id
        self.token_text, self.call_ids, self.index = token_text, [], index

    def choice(self, index: int) -> "ChatStream":
        """The stream of choice `index` of the same completion (its id and time)."""
        other = ChatStream(self.model, self.token_text, index)
        other.id, other.created = self.id, self.created
        return other

    def chunk(self, delta: dict, reason: Optional[str] = None, tokens=()) -> dict:
        choice = {"index": self.index, "delta": delta, "logprobs":
                  self.token_text.chat_logprobs(list(tokens)), "finish_reason": reason}
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": [choice]}

    def usage_chunk(self, finish: Optional[Finish] = None,
                    totals: Optional[dict] = None) -> dict:
        """The usage chunk: of `finish`, or the given `totals` (several choices)."""
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": [],
                "usage": totals if totals is not None else usage(finish)}

    def delta(self, d: Delta) -> dict:
        if d.kind in ("reasoning", "content"):
            return {"reasoning_content": d.text, "reasoning": d.text} \
                if d.kind == "reasoning" else {"content": d.text}
        if d.kind == "call":
            self.call_ids.append(new_id("call_"))
            return {"tool_calls": [{"index": d.index, "id": self.call_ids[d.index],
                                    "type": "function",
                                    "function": {"name": d.text, "arguments": ""}}]}
        return {"tool_calls": [{"index": d.index, "function": {"arguments": d.text}}]}


def chat_completion(model_id: str, reply: Reply, finish: Finish, tokens: list,
                    token_text: TokenText) -> dict:
    """A whole (non-streamed) chat completion."""
    message = {"role": "assistant", "content": reply.content or (None if reply.calls else ""),
               "refusal": None}
    if reply.reasoning:
        message["reasoning_content"] = message["reasoning"] = reply.reasoning
    if reply.calls:
        message["tool_calls"] = [{"id": new_id("call_"), "type": "function", "function": call}
                                 for call in reply.calls]
    choice = {"index": 0, "message": message, "logprobs": token_text.chat_logprobs(tokens),
              "finish_reason": finish_reason(finish, bool(reply.calls))}
    return {"id": new_id("chatcmpl-"), "object": "chat.completion", "created": int(time.time()),
            "model": model_id, "choices": [choice], "usage": usage(finish)}


def completion_chunk(cid: str, created: int, model_id: str, text: str,
                     logprobs: Optional[dict], reason: Optional[str], index: int = 0) -> dict:
    return {"id": cid, "object": "text_completion", "created": created, "model": model_id,
            "choices": [{"index": index, "text": text, "logprobs": logprobs,
                         "finish_reason": reason}]}


def completion_usage_chunk(cid: str, created: int, model_id: str, totals: dict) -> dict:
    return {"id": cid, "object": "text_completion", "created": created, "model": model_id,
            "choices": [], "usage": totals}


def completion(model_id: str, tokens: list, finish: Finish, token_text: TokenText) -> dict:
    text = "".join(t.text for t in tokens) + finish.text
    body = completion_chunk(new_id("cmpl-"), int(time.time()), model_id, text,
                            token_text.completion_logprobs(tokens, 0), finish_reason(finish))
    body["usage"] = usage(finish)
    return body

