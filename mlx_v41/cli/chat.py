"""`mlx_v41.chat`: the chat REPL over a `ChatSession` (commands, Ctrl-C, scripted stdin).

    mlx_v41.chat --model demo
    mlx_v41.chat --model path/to/DeepSeek-V4.1-Flash --no-thinking
    mlx_v41.chat --model path/to/DeepSeek-V4.1-Flash --dspark --num-draft-tokens 3
"""

from __future__ import annotations

import os
import select
import sys
from pathlib import Path
from typing import Optional

from .args import ArgumentParser, add_model_arguments, decode_settings
from ..checkpoint.source import load
from ..chat.session import DEFAULT_MAX_TOKENS, ChatSession, format_stats





DEFAULT_SEED = 0



SIGNAL_POLL_SECONDS = 0.2  # how long a wait for input may hide a Ctrl-C



HELP = """commands:
  /help  (h)            this list
  /reset (r)            start a new conversation
  /save PATH            save the session (prompt cache + transcript)
  /load PATH            load a saved session
  /stats                statistics of the last turn
  /image PATH           attach an image (path, URL or data: URI) to the next message
  /thinking [on|off]    toggle thinking mode
  /dspark [on|off]      toggle DSpark speculative decoding (needs --dspark)
  /quit  (q)            leave (also Ctrl-D); Ctrl-C stops a reply"""



def run_command(session: ChatSession, line: str, out) -> bool:
    """Carry out a /command; False means quit."""
    name, _, arg = line.partition(" ")
    name, arg = {"q": "/quit", "r": "/reset", "h": "/help"}.get(name, name), arg.strip()
    if name in ("/quit", "/exit"):
        return False
    if name == "/help":
        print(HELP, file=out)
    elif name == "/reset":
        session.reset()
        print("[new conversation]", file=out)
    elif name in ("/save", "/load", "/image") and not arg:
        print(f"error: {name} needs a {'file path' if name != '/image' else 'path or URL'}",
              file=sys.stderr)
    elif name == "/save":
        session.save(Path(arg).expanduser())
        print(f"[saved to {arg}]", file=out)
    elif name == "/load":
        session.load(Path(arg).expanduser())
        print(f"[loaded {arg}: {len(session.messages)} messages]", file=out)
    elif name == "/image":
        session.attach(arg if "://" in arg or arg.startswith("data:")
                       else str(Path(arg).expanduser()))
        print(f"[image {arg} attached to the next message]", file=out)
    elif name == "/stats":
        print(format_stats(session), file=out)
    elif name == "/thinking" and arg in ("", "on", "off"):
        session.thinking = {"on": True, "off": False}.get(arg, not session.thinking)
        print(f"[thinking {'on' if session.thinking else 'off'}]", file=out)
    elif name == "/dspark" and arg in ("", "on", "off"):
        switch_dspark(session, arg, out)
    else:
        print(f"error: unknown command {line!r} (/help lists them)", file=sys.stderr)
    return True



def switch_dspark(session: ChatSession, arg: str, out) -> None:
    """/dspark [on|off]: speculative decoding for the next turns (a model with the drafter)."""
    is_on = {"on": True, "off": False}.get(arg, session.draft is None)
    if is_on and "dspark" not in session.model:
        raise ValueError("/dspark needs the DSpark drafter: start mlx_v41.chat with --dspark "
                         "(a checkpoint with the mtp.* tensors)")
    session.draft = "dspark" if is_on else None
    print(f"[dspark {'on' if is_on else 'off'}]", file=out)



class LineReader:
    """Lines from a file descriptor, waiting in short select() slices. A Ctrl-C that the kernel
    hands to one of MLX's threads would not interrupt a read() blocked in the main thread (only
    the main thread runs Python's handlers); here the main thread notices it within a slice."""

    def __init__(self, fd: int):
        self.fd, self.pending = fd, b""

    def readline(self) -> Optional[str]:
        """The next line without its newline; None at the end of input."""
        while b"\n" not in self.pending:
            if not select.select([self.fd], [], [], SIGNAL_POLL_SECONDS)[0]:
                continue
            chunk = os.read(self.fd, 4096)
            if not chunk:  # end of input (Ctrl-D on an empty terminal line)
                line, self.pending = self.pending, b""
                return line.decode(errors="replace") if line else None
            self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        return line.decode(errors="replace")



def _lines(stream):
    """A readline() for `stream`: a LineReader on its descriptor, or its own readline()."""
    try:
        return LineReader(stream.fileno()).readline
    except (AttributeError, OSError, ValueError):  # e.g. io.StringIO in tests
        def readline():
            line = stream.readline()
            return line.removesuffix("\n") if line else None
        return readline



def repl(session: ChatSession, interactive: bool, out=None, stream=None) -> int:
    """Read messages and /commands until /quit, end of input or Ctrl-C at the prompt."""
    out = out or sys.stdout
    readline = _lines(stream or sys.stdin)
    if interactive:
        print("mlx_v41.chat: /help lists the commands; Ctrl-C stops a reply, Ctrl-D quits.",
              file=out)
    while True:
        try:
            print(">> " if interactive else "", end="", file=out, flush=True)
            line = readline()
        except KeyboardInterrupt:
            line = None
        if line is None:
            print(file=out)
            return 0
        line = line.strip()
        if not line:
            continue
        try:
            if line.startswith("/") or line in ("q", "r", "h"):
                if not run_command(session, line, out):
                    return 0
                continue
            for response in session.reply(line):
                print(response.text, end="", flush=True, file=out)
            print(file=out)
        except KeyboardInterrupt:
            session.interrupt()
            print("\n[interrupted]", file=out, flush=True)
        except (ValueError, OSError) as e:  # bad command argument, prompt too long, bad file
            print(f"error: {e}", file=sys.stderr, flush=True)



def setup_arg_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="mlx_v41.chat",
                            description="Chat with DeepSeek V4.1 Flash (multi-turn, cached).")
    add_model_arguments(parser, DEFAULT_MAX_TOKENS, DEFAULT_SEED)
    return parser



def main(argv=None) -> int:
    import mlx.core as mx

    args = setup_arg_parser().parse_args(argv)
    try:
        mx.random.seed(args.seed)
        if args.model == "demo":
            print("demo model: a tiny random checkpoint, so the text is random", file=sys.stderr)
        model, tokenizer = load(args.model, prefill_mode=args.prefill_mode, dspark=args.dspark,
                                head_dtype=args.head_dtype)
        session = ChatSession(model, tokenizer, system_prompt=args.system_prompt,
                              thinking=args.thinking, reasoning_effort=args.reasoning_effort,
                              max_tokens=args.max_tokens,
                              prefill_step_size=args.prefill_step_size,
                              show_progress=True, **decode_settings(args))
    except KeyboardInterrupt:
        print("\n[interrupted]", file=sys.stderr)
        return 130
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return repl(session, interactive=sys.stdin.isatty())
