"""Where the chat REPL's messages come from: a terminal through `readline` (line editing, the
arrow keys and Ctrl-R over the history), else a stream read in short slices (scripted stdin, or
rank 0's lines under a group); and multi-line messages, the same in both: a line opening with
`\"\"\"` runs until a line ending with `\"\"\"` (Ollama's convention).
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

SIGNAL_POLL_SECONDS = 0.2  # how long a wait for input may hide a Ctrl-C
WAKE_SECONDS, WAKES = 0.1, 30  # a Ctrl-C's wake-ups of the wait for input: every 0.1 s, 3 s
BLOCK = '"""'  # opens and closes a multi-line message
PROMPT, CONTINUATION_PROMPT = ">> ", ".. "
HISTORY_LENGTH = 1000  # entries a history file keeps


class LineReader:
    """Lines from a file descriptor, waiting in short select() slices. A Ctrl-C that the kernel
    hands to one of MLX's threads would not interrupt a read() blocked in the main thread (only
    the main thread runs Python's handlers); here the main thread notices it within a slice."""

    def __init__(self, fd: int):
        self.fd, self.pending = fd, b""

    def readline(self, timeout: Optional[float] = None) -> Optional[str]:
        """The next line without its newline; None at the end of input. With `timeout`:
        TimeoutError when no whole line came in that many seconds (what came is kept)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.pending:
            wait = SIGNAL_POLL_SECONDS
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    raise TimeoutError
            if not select.select([self.fd], [], [], wait)[0]:
                continue
            chunk = os.read(self.fd, 4096)
            if not chunk:  # end of input (Ctrl-D on an empty terminal line)
                line, self.pending = self.pending, b""
                return line.decode(errors="replace") if line else None
            self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        return line.decode(errors="replace")


def stream_readline(stream) -> Callable[[], Optional[str]]:
    """A readline(timeout=None) for `stream`: a LineReader on its descriptor, or its own
    readline() (which does not time out)."""
    try:
        return LineReader(stream.fileno()).readline
    except (AttributeError, OSError, ValueError):  # e.g. io.StringIO in tests
        def readline(timeout: Optional[float] = None):
            line = stream.readline()
            return line.removesuffix("\n") if line else None
        return readline


@dataclass
class StreamLines:
    """Lines from a readline() callable, the prompt printed to `out`; no history."""

    readline: Callable[[], Optional[str]]
    out: object

    def read(self, prompt: str) -> Optional[str]:
        print(prompt, end="", file=self.out, flush=True)
        return self.readline()

    def remember(self, entry: str) -> None:
        pass

    def close(self) -> None:
        pass


def _wake(signum, frame) -> None:
    """SIGUSR1 while `input()` waits: it only wakes the wait, so pending handlers run."""


@contextmanager
def interrupts_reach_input():
    """A Ctrl-C while `input()` waits stops the wait. Readline waits in select() on the
    terminal, which a signal interrupts only in the thread the kernel hands it to, and that may
    be one of MLX's threads: then Python's SIGINT handler is pending, but the main thread
    sleeps on. A watcher thread sees every signal on the wakeup fd and, for a SIGINT, sends
    SIGUSR1 (a no-op handler) to the main thread, whose interrupted select then runs the
    pending handlers: KeyboardInterrupt. (A SIGINT that reached the main thread itself already
    did; the extra SIGUSR1 changes nothing.) It sends SIGUSR1 again every WAKE_SECONDS, up to
    WAKES times, until the wait ends: one that lands before readline has entered its select
    (the prompt is printed first) wakes nothing, and the select would sleep on."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.signal(signal.SIGUSR1, _wake)  # kept: a late SIGUSR1 must find it
    old_fd = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    main, done = threading.main_thread().ident, threading.Event()

    def watch():
        # SIGUSR1s still to send for the last SIGINT, and when the next is due. The wake-ups
        # land on the wakeup fd too, so the select returns at once after each: the pacing is
        # by the clock, not by the select (else all WAKES go at once and merge into one).
        wakes, due = 0, 0.0
        while not done.is_set():
            timeout = max(0.0, due - time.monotonic()) if wakes else WAKE_SECONDS
            if select.select([read_end], [], [], timeout)[0] and \
                    signal.SIGINT in os.read(read_end, 64):
                wakes, due = WAKES, time.monotonic()
            if wakes and time.monotonic() >= due and not done.is_set():
                signal.pthread_kill(main, signal.SIGUSR1)
                wakes, due = wakes - 1, time.monotonic() + WAKE_SECONDS

    watcher = threading.Thread(target=watch, name="mlx_v41-ctrl-c", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
        signal.set_wakeup_fd(old_fd)
        os.close(read_end)
        os.close(write_end)


class TerminalLines:
    """Lines typed at a terminal through `input()` with the `readline` module loaded: editing,
    the arrow keys, Ctrl-R. The history holds whole messages (a block as one entry, recalled
    whole); it lives in memory, and with `history_file` is read at start and written by
    `close()`, one JSON string a line (readline's own files split an entry at its newlines)."""

    def __init__(self, readline, history_file: Optional[Path] = None):
        self.readline, self.history_file = readline, history_file
        readline.set_auto_history(False)  # `remember` adds entries: one per message
        if history_file is not None and history_file.is_file():
            try:
                for line in history_file.read_text(encoding="utf-8").splitlines():
                    readline.add_history(json.loads(line))
            except (OSError, ValueError) as e:
                print(f"warning: history file {history_file}: cannot read it ({e})",
                      file=sys.stderr)

    def read(self, prompt: str) -> Optional[str]:
        try:
            with interrupts_reach_input():
                return input(prompt)
        except EOFError:  # Ctrl-D
            return None

    def remember(self, entry: str) -> None:
        count = self.readline.get_current_history_length()
        if entry and (count == 0 or self.readline.get_history_item(count) != entry):
            self.readline.add_history(entry)

    def close(self) -> None:
        if self.history_file is None:
            return
        count = self.readline.get_current_history_length()
        entries = [self.readline.get_history_item(i)
                   for i in range(max(1, count - HISTORY_LENGTH + 1), count + 1)]
        try:
            self.history_file.write_text("".join(json.dumps(e) + "\n" for e in entries),
                                         encoding="utf-8")
        except OSError as e:
            print(f"warning: history file {self.history_file}: cannot write it ({e})",
                  file=sys.stderr)


def terminal_lines(history_file: Optional[str] = None) -> Optional[TerminalLines]:
    """`TerminalLines` over the `readline` module; None where Python has none (Windows)."""
    try:
        import readline
    except ImportError:
        return None
    return TerminalLines(readline, Path(history_file).expanduser() if history_file else None)


@dataclass
class Message:
    """What the user sent: one line (stripped; it may be a /command) or a block's text."""

    text: str
    is_block: bool = False


def read_message(lines, interactive: bool, out, err) -> Optional[Message]:
    """The next message from `lines` (None: end of input). A line opening with `\"\"\"` takes
    the lines up to one ending with `\"\"\"`; `\"\"\"text\"\"\"` is a block on one line (a
    block recalled from the history too). Ctrl-C inside a block drops it (an empty message);
    the input ending inside one ends the chat, the block unsent."""
    line = lines.read(PROMPT if interactive else "")
    if line is None or not line.lstrip().startswith(BLOCK):
        if line is not None and line.strip():
            lines.remember(line.strip())
        return None if line is None else Message(line.strip())
    text = line.lstrip()[len(BLOCK):]
    if len(text.rstrip()) >= len(BLOCK) and text.rstrip().endswith(BLOCK):
        block = text.rstrip()[:-len(BLOCK)]
    else:
        block = _rest_of_block(lines, [text] if text.strip() else [], interactive, out, err)
    if block is None:
        return None
    if block.strip():
        lines.remember(BLOCK + block + BLOCK)
    return Message(block.strip("\n"), is_block=True)


def _rest_of_block(lines, taken: list, interactive: bool, out, err) -> Optional[str]:
    while True:
        try:
            line = lines.read(CONTINUATION_PROMPT if interactive else "")
        except KeyboardInterrupt:
            print("\n[block dropped]", file=out, flush=True)
            return ""
        if line is None:
            print(f"error: the input ended inside a {BLOCK} block; it was not sent", file=err)
            return None
        if line.rstrip().endswith(BLOCK):
            last = line.rstrip()[:-len(BLOCK)]
            return "\n".join(taken + ([last] if last.strip() else []))
        taken.append(line)
