"""A Responses API response built from a reply's deltas: its output items (`reasoning` with
`reasoning_text` content, `message` with one `output_text` part, `function_call`), the stream
events that build them (each with its `sequence_number`), its status and usage.
"""

from __future__ import annotations

import json
from typing import Optional

from ..engine import Finish
from ..reply_parser import Delta
from ..serving import new_id

ITEM_OF_DELTA = {"reasoning": "reasoning", "content": "message", "call": "function_call",
                 "arguments": "function_call"}
TERMINAL_EVENTS = {"completed": "response.completed", "incomplete": "response.incomplete",
                   "cancelled": "response.incomplete"}


def sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


def usage(finish: Finish, reasoning_tokens: int) -> dict:
    return {"input_tokens": finish.prompt_tokens,
            "input_tokens_details": {"cached_tokens": finish.cached_tokens,
                                     "cache_write_tokens": 0},  # the server caches by itself
            "output_tokens": finish.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": finish.prompt_tokens + finish.completion_tokens}


class ResponseBuilder:
    """One response: `start`, then `add` each reply delta, then `finish` (or `fail`); each
    returns the stream events it made. `body` is the response object, `output` growing as
    items finish."""

    def __init__(self, body: dict):
        self.body, self.sequence = body, 0
        self.item: Optional[dict] = None  # the open output item
        self.text = ""  # the open item's text (reasoning, output text or arguments)
        self.reasoning_tokens = 0

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _snapshot(self) -> dict:
        return dict(self.body, output=list(self.body["output"]))

    def start(self) -> list:
        return [self._event("response.created", response=self._snapshot()),
                self._event("response.in_progress", response=self._snapshot())]

    def add(self, delta: Delta) -> list:
        if delta.kind == "cut":  # a call cut off by max_output_tokens: not an output item
            return self._close("incomplete", keep=False)
        kind, events = ITEM_OF_DELTA[delta.kind], []
        if delta.kind == "call" or self.item is None or self.item["type"] != kind:
            events += self._close("completed")
            events += self._open(kind, delta.text)
        if delta.kind != "call":
            self.text += delta.text
            events.append(self._delta(delta.text))
        return events

    def finish(self, finish: Finish) -> list:
        status = {"stop": "completed", "length": "incomplete"}.get(finish.reason, "cancelled")
        events = self._close(status)
        if not self.body["output"]:  # an empty reply is an empty message
            events += self._open("message", "") + self._close(status)
        self.body.update(status=status, usage=usage(finish, self.reasoning_tokens))
        if finish.reason == "length":
            self.body["incomplete_details"] = {"reason": "max_output_tokens"}
        return events + [self._event(TERMINAL_EVENTS[status], response=self._snapshot())]

    def fail(self, message: str) -> list:
        self.body.update(status="failed", error={"code": "server_error", "message": message})
        return [self._event("error", code="server_error", message=message, param=None),
                self._event("response.failed", response=self._snapshot())]

    # ------------------------------------------------------------------ items

    def _where(self) -> dict:
        return {"item_id": self.item["id"], "output_index": len(self.body["output"])}

    def _open(self, kind: str, name: str) -> list:
        self.text = ""
        if kind == "function_call":
            self.item = {"id": new_id("fc_"), "type": "function_call", "call_id": new_id("call_"),
                         "name": name, "arguments": "", "status": "in_progress"}
            return [self._event("response.output_item.added", output_index=len(
                self.body["output"]), item=dict(self.item))]
        if kind == "reasoning":
            self.item = {"id": new_id("rs_"), "type": "reasoning", "summary": [], "content": [],
                         "status": "in_progress"}
        else:
            self.item = {"id": new_id("msg_"), "type": "message", "role": "assistant",
                         "status": "in_progress", "content": []}
        return [self._event("response.output_item.added", output_index=len(self.body["output"]),
                            item=dict(self.item)),
                self._event("response.content_part.added", content_index=0,
                            part=self._part(), **self._where())]

    def _part(self) -> dict:
        if self.item["type"] == "reasoning":
            return {"type": "reasoning_text", "text": self.text}
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}

    def _delta(self, text: str) -> dict:
        kind = self.item["type"]
        if kind == "function_call":
            return self._event("response.function_call_arguments.delta", delta=text,
                               **self._where())
        if kind == "reasoning":
            return self._event("response.reasoning_text.delta", content_index=0, delta=text,
                               **self._where())
        return self._event("response.output_text.delta", content_index=0, delta=text,
                           logprobs=[], **self._where())

    def _close(self, status: str, keep: bool = True) -> list:
        """End the open item (if any): its done events, then it joins `output` (with
        `keep`)."""
        if self.item is None:
            return []
        item, where, events = self.item, self._where(), []
        if item["type"] == "function_call":
            item["arguments"] = self.text
            events.append(self._event("response.function_call_arguments.done",
                                      arguments=self.text, **where))
        else:
            part = self._part()
            if item["type"] == "reasoning":
                events.append(self._event("response.reasoning_text.done", content_index=0,
                                          text=self.text, **where))
            else:
                events.append(self._event("response.output_text.done", content_index=0,
                                          text=self.text, logprobs=[], **where))
            events.append(self._event("response.content_part.done", content_index=0, part=part,
                                      **where))
            item["content"] = [part]
        item["status"] = "completed" if status == "completed" else "incomplete"
        events.append(self._event("response.output_item.done",
                                  output_index=where["output_index"], item=item))
        if keep:
            self.body["output"].append(item)
        self.item = None
        return events
