"""A reply split as it streams: reasoning (thinking mode, up to `</think>`), content, and the
DSML tool-call block as OpenAI tool-call deltas (the name when an invoke opens, then the
JSON arguments a parameter at a time). The grammar is `chat.completion.parse_completion`'s; the
whole text fed at once gives its fields. Text that could still become a marker is held back
until it is decided. A malformed call block is passed on as content text, unparsed; a reply
cut off by its token limit inside a call block ends with no markup: the complete calls stand,
a call that did not close is taken back (a "cut" delta).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Optional

from ..chat import format as cf
from ..chat.completion import held_suffix

_INVOKE = re.compile(rf'\s*{cf.INVOKE_OPEN} name="([^"]*)">')
_PARAM = re.compile(rf'\s*{cf.PARAM_OPEN} name="([^"]*)" string="(true|false)">(.*?)'
                    rf'{cf.PARAM_CLOSE}', re.S)
_INVOKE_END = re.compile(rf"\s*{cf.INVOKE_CLOSE}")
_CALLS_END = re.compile(rf"\s*{cf.CALLS_CLOSE}")
CONTENT_MARKERS = ("\n\n" + cf.CALLS_OPEN, cf.CALLS_OPEN)


@dataclass
class Delta:
    """One piece of a reply. kind: "reasoning" / "content" (text), "call" (a tool call opens:
    index, name), "arguments" (index, a fragment of its JSON arguments; `closes` on the last
    one, which ends the object), "cut" (the reply ended inside call `index`, whose arguments
    never closed: it is not a call)."""

    kind: str
    text: str = ""
    index: int = 0
    closes: bool = False


@dataclass
class _Call:
    index: int
    has_arguments: bool = False


@dataclass
class ReplyParser:
    """Feed decoded text with `feed`, end with `finish`; both return `Delta`s."""

    thinking: bool
    phase: str = ""
    buffer: str = ""
    calls: int = 0
    call: Optional[_Call] = None
    block: str = ""  # the call block's text consumed so far (while no call has opened)
    out: list = field(default_factory=list)

    def __post_init__(self):
        self.phase = self.phase or ("reasoning" if self.thinking else "content")

    def feed(self, text: str) -> list:
        self.buffer += text
        self._run(final=False)
        return self._take()

    def finish(self, cut: bool = False) -> list:
        """The end of the reply: held text is released (an unfinished reasoning stays
        reasoning; an unfinished call block becomes content). With `cut` (the reply reached
        its token limit) an unfinished call block is dropped instead, as is text held back
        as a marker's start; an open call ends with a "cut" delta."""
        if cut and self.phase in ("calls", "invoke"):
            if self.phase == "invoke":
                self._emit("cut", index=self.call.index)
            self.buffer, self.block, self.phase = "", "", "done"
        if cut and self.phase in ("reasoning", "content"):
            markers = (cf.THINK_END,) if self.phase == "reasoning" else CONTENT_MARKERS
            self.buffer = self.buffer[:len(self.buffer) - held_suffix(self.buffer, markers)]
        self._run(final=True)
        if self.phase in ("reasoning", "content"):
            self._emit(self.phase, self.buffer)
        self.buffer = ""
        return self._take()

    def _take(self) -> list:
        out, self.out = self.out, []
        return out

    def _emit(self, kind: str, text: str = "", index: int = 0, closes: bool = False) -> None:
        if text or kind in ("call", "arguments", "cut"):
            if self.out and kind in ("reasoning", "content") and self.out[-1].kind == kind:
                self.out[-1].text += text
            else:
                self.out.append(Delta(kind, text, index, closes))

    def _close_call(self) -> None:
        """The open call's arguments end: the object's last brace (or `{}`)."""
        self._emit("arguments", "}" if self.call.has_arguments else "{}", self.call.index,
                   closes=True)

    def _run(self, final: bool) -> None:
        steps = {"reasoning": self._reasoning, "content": self._content, "calls": self._calls,
                 "invoke": self._invoke, "done": self._done, "raw": self._raw}
        while steps[self.phase](final):
            pass

    # Each step consumes what it can and returns True when the phase changed.

    def _reasoning(self, final: bool) -> bool:
        before, found, after = self.buffer.partition(cf.THINK_END)
        if found:
            self._emit("reasoning", before)
            self.buffer, self.phase = after, "content"
            return True
        self._release("reasoning", (cf.THINK_END,), final)
        return False

    def _content(self, final: bool) -> bool:
        before, found, after = self.buffer.partition(cf.CALLS_OPEN)
        if found:
            content = before.removesuffix("\n\n")
            self._emit("content", content)
            self.block = before[len(content):] + found  # content again if no call parses
            self.buffer, self.phase = after, "calls"
            return True
        self._release("content", CONTENT_MARKERS, final)
        return False

    def _release(self, kind: str, markers, final: bool) -> None:
        keep = 0 if final else held_suffix(self.buffer, markers)
        self._emit(kind, self.buffer[:len(self.buffer) - keep])
        self.buffer = self.buffer[len(self.buffer) - keep:]

    def _calls(self, final: bool) -> bool:
        """Between invokes: an invoke opens or the block closes."""
        match = _INVOKE.match(self.buffer)
        if match:
            self.call = _Call(self.calls)
            self.calls += 1
            self._emit("call", match.group(1), self.call.index)
            self.buffer, self.phase, self.block = self.buffer[match.end():], "invoke", ""
            return True
        match = _CALLS_END.match(self.buffer)
        if match:
            self.buffer, self.phase = self.buffer[match.end():], "done"
            return True
        return self._maybe_malformed((cf.INVOKE_OPEN, cf.CALLS_CLOSE), final)

    def _invoke(self, final: bool) -> bool:
        """Inside an invoke: a whole parameter, or the invoke's end."""
        match = _PARAM.match(self.buffer)
        if match:
            return self._parameter(match)
        match = _INVOKE_END.match(self.buffer)
        if match:
            self._close_call()
            self.buffer, self.phase = self.buffer[match.end():], "calls"
            return True
        return self._maybe_malformed((cf.PARAM_OPEN, cf.INVOKE_CLOSE), final)

    def _parameter(self, match) -> bool:
        name, is_string, value = match.groups()
        if is_string == "false":
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                return self._go_raw()
        head = ", " if self.call.has_arguments else "{"
        self._emit("arguments", f"{head}{json.dumps(name, ensure_ascii=False)}: "
                                f"{json.dumps(value, ensure_ascii=False)}", self.call.index)
        self.call.has_arguments = True
        self.buffer = self.buffer[match.end():]
        return True

    def _maybe_malformed(self, openers, final: bool) -> bool:
        """Wait while the buffer may still become one of `openers`' tags; else it is raw."""
        text = self.buffer.lstrip()
        pending = any(text.startswith(o) or o.startswith(text) for o in openers)
        if final or not pending:
            return self._go_raw()
        return False

    def _go_raw(self) -> bool:
        """Stop parsing: an open call's arguments are closed, and the rest of the text (from
        the block's start when no call opened) is content."""
        if self.phase == "invoke":
            self._close_call()
        self.buffer, self.block, self.phase = self.block + self.buffer, "", "raw"
        return True

    def _done(self, final: bool) -> bool:
        """After the call block only whitespace belongs to the turn; anything else is raw."""
        if self.buffer.strip():
            self.phase = "raw"
            return True
        if final:
            self.buffer = ""
        return False

    def _raw(self, final: bool) -> bool:
        self._emit("content", self.buffer)
        self.buffer = ""
        return False


@dataclass
class Reply:
    """A parsed reply assembled from deltas: what a non-streaming response returns."""

    reasoning: str = ""
    content: str = ""
    calls: list = field(default_factory=list)  # [{"name", "arguments"}]

    def add(self, deltas: list) -> None:
        for d in deltas:
            if d.kind == "reasoning":
                self.reasoning += d.text
            elif d.kind == "content":
                self.content += d.text
            elif d.kind == "call":
                self.calls.append({"name": d.text, "arguments": ""})
            elif d.kind == "cut":
                del self.calls[d.index]
            else:
                self.calls[d.index]["arguments"] += d.text


def parse_reply(text: str, thinking: bool, cut: bool = False) -> Reply:
    """The fields of a whole reply; `cut`: it reached its token limit (`finish`)."""
    parser, reply = ReplyParser(thinking), Reply()
    reply.add(parser.feed(text))
    reply.add(parser.finish(cut))
    return reply
