"""How `mlx_v41.generate` and `mlx_v41.chat` print a thinking-mode reply as it streams: the
reasoning (the text before `</think>`, as `chat.completion.parse_completion` splits a turn) apart
from the answer. On a terminal the reasoning is dimmed; elsewhere (a pipe, a file, NO_COLOR set)
a line `[thinking]` comes before it and a line `[answer]` before the answer. Hidden, only the
answer is printed (a terminal shows a dimmed `thinking...` until the answer starts).
"""

from __future__ import annotations

import os

from ..chat.completion import held_suffix
from ..chat.format import THINK_END

DIM, RESET = "\x1b[2m", "\x1b[0m"
CLEAR_LINE = "\r\x1b[2K"  # back to the line's start, then erase it
THINKING_MARK, ANSWER_MARK = "[thinking]", "[answer]"
THINKING_NOTE = "thinking..."  # on a terminal, in place of hidden reasoning


def is_styled(out) -> bool:
    """Whether `out` takes ANSI styles: a terminal, and NO_COLOR (no-color.org) unset."""
    isatty = getattr(out, "isatty", None)
    return bool(isatty and isatty()) and not os.environ.get("NO_COLOR")


class ReplyPrinter:
    """Prints a reply's text pieces to `out` (`write`, then `finish`). `thinking`: the prompt
    opened a `<think>` block, so the reply starts with reasoning (else it is all answer and
    printed as is). `show`: print the reasoning; `styled`: ANSI styles (default: `is_styled`)."""

    def __init__(self, out, thinking: bool, show: bool = True, styled=None):
        self.out, self.show = out, show
        self.styled = is_styled(out) if styled is None else styled
        self.is_reasoning = thinking
        self.held = ""  # the end of the reasoning that may be the start of `</think>`
        self.has_reasoning = False  # whether reasoning text has been printed (or noted)
        self.ends_line = True  # whether the printed text ends with a newline

    def write(self, text: str) -> None:
        if not self.is_reasoning:
            self._print(text)
            return
        text = self.held + text
        reasoning, found, answer = text.partition(THINK_END)
        if found:
            self.held = ""
            self._reasoning(reasoning)
            self._start_answer()
            self._print(answer)
            return
        keep = held_suffix(text, (THINK_END,))
        self.held = text[len(text) - keep:]
        self._reasoning(text[:len(text) - keep])

    def finish(self) -> None:
        """The reply ended: held text is reasoning after all."""
        if self.is_reasoning and self.held:
            self._reasoning(self.held)
        self.held = ""
        self.out.flush()

    def _reasoning(self, text: str) -> None:
        if not text:
            return
        if not self.show:
            if self.styled and not self.has_reasoning:
                self._print(f"{DIM}{THINKING_NOTE}{RESET}", ends_line=False)
            self.has_reasoning = True
            return
        if not self.has_reasoning and not self.styled:
            self._print(f"{THINKING_MARK}\n")
        self.has_reasoning = True
        # Styled a piece at a time, so an interrupted reply leaves the terminal plain.
        self._print(f"{DIM}{text}{RESET}" if self.styled else text, ends_line=text.endswith("\n"))

    def _start_answer(self) -> None:
        self.is_reasoning = False
        if not self.show:
            if self.styled and self.has_reasoning:
                self._print(CLEAR_LINE)
            return
        if self.styled:  # a blank line after the dimmed reasoning
            self._print(("\n" if self.ends_line else "\n\n") if self.has_reasoning else "")
        else:
            self._print(("" if self.ends_line else "\n") + f"{ANSWER_MARK}\n")

    def _print(self, text: str, ends_line=None) -> None:
        if text:
            print(text, end="", file=self.out, flush=True)
            self.ends_line = text.endswith("\n") if ends_line is None else ends_line
