"""`mlx_v41.chat`: the chat REPL over a `ChatSession` (commands, Ctrl-C, scripted stdin).

    mlx_v41.chat --model demo
    mlx_v41.chat --model path/to/DeepSeek-V4.1-Flash --no-thinking
    mlx_v41.chat --model path/to/DeepSeek-V4.1-Flash --dspark --num-draft-tokens 3
    mlx.launch -n 2 --python $(which python) -- -m mlx_v41.chat --model PATH --pipeline
"""

from __future__ import annotations

import os
import select
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from .args import (ArgumentParser, add_model_arguments, decode_settings, load_options,
                   report_experts)
from ..checkpoint.source import load
from ..chat.session import DEFAULT_MAX_TOKENS, ChatSession, format_stats
from ..distributed.chat import SharedChatSession
from ..distributed.cli import add_distributed_arguments, distributed_loader
from ..distributed.link import DistributedError, is_backend_error
from ..generation.group import ONE_PROCESS


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


@dataclass
class Ranks:
    """The REPL run by every rank of a `--pipeline` / `--tensor-parallel` group: rank 0's lines
    reach every rank (`readline`), errors print on rank 0 only (`err`)."""

    readline: Callable[[], Optional[str]]
    err: object
    switch: str
    rank: int


def run_command(session: ChatSession, line: str, out, err=None) -> bool:
    """Carry out a /command; False means quit."""
    err = err or sys.stderr
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
              file=err)
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
        print(f"error: unknown command {line!r} (/help lists them)", file=err)
    return True


def switch_dspark(session: ChatSession, arg: str, out) -> None:
    """/dspark [on|off]: speculative decoding for the next turns (a model with the drafter)."""
    is_on = {"on": True, "off": False}.get(arg, session.draft is None)
    if is_on and not session.model.drafting:
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


def repl(session: ChatSession, interactive: bool, out=None, stream=None,
         ranks: Optional[Ranks] = None) -> int:
    """Read messages and /commands until /quit, end of input or Ctrl-C at the prompt. Under
    `ranks` every rank runs it on rank 0's lines, and Ctrl-C during a reply is raised (it ends
    every rank: the others are inside the reply's collectives)."""
    out = out or sys.stdout
    err = ranks.err if ranks else sys.stderr
    readline = ranks.readline if ranks else _lines(stream or sys.stdin)
    if interactive:
        ctrl_c = f"Ctrl-C ends every rank ({ranks.switch})" if ranks else "Ctrl-C stops a reply"
        print(f"mlx_v41.chat: /help lists the commands; {ctrl_c}, Ctrl-D quits.", file=out)
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
                if not run_command(session, line, out, err):
                    return 0
                continue
            for response in session.reply(line):
                print(response.text, end="", flush=True, file=out)
            print(file=out)
        except KeyboardInterrupt:
            if ranks:
                raise
            session.interrupt()
            print("\n[interrupted]", file=out, flush=True)
        except (ValueError, OSError) as e:  # bad command argument, prompt too long, bad file
            print(f"error: {e}", file=err, flush=True)


def setup_arg_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="mlx_v41.chat",
                            description="Chat with DeepSeek V4.1 Flash (multi-turn, cached).")
    add_model_arguments(parser, DEFAULT_MAX_TOKENS, DEFAULT_SEED)
    add_distributed_arguments(parser)
    return parser


def group_ranks(args, group) -> Ranks:
    """`Ranks` for a model loaded over a group (`group`: its `RankGroup`)."""
    link = group.link
    local = _lines(sys.stdin) if link.rank == 0 else None
    from ..distributed.lines import shared_readline

    return Ranks(shared_readline(link, local),
                 sys.stderr if link.rank == 0 else open(os.devnull, "w"),
                 "--pipeline" if args.pipeline else "--tensor-parallel", link.rank)


def main(argv=None) -> int:
    import mlx.core as mx

    args = setup_arg_parser().parse_args(argv)
    try:
        mx.random.seed(args.seed)
        if args.model == "demo":
            print("demo model: a tiny random checkpoint, so the text is random", file=sys.stderr)
        loader = distributed_loader(args)
        model, tokenizer = (loader or load)(args.model, prefill_mode=args.prefill_mode,
                                            dspark=args.dspark, head_dtype=args.head_dtype,
                                            **load_options(args))
        report_experts(model)
        if loader is None:
            group, kind, ranks = ONE_PROCESS, ChatSession, None
        else:  # a group model: rank 0 reads the images and the input lines
            group, kind = model.group, SharedChatSession
            ranks = group_ranks(args, group)
        session = kind(model, tokenizer, group=group, system_prompt=args.system_prompt,
                       thinking=args.thinking, reasoning_effort=args.reasoning_effort,
                       max_tokens=args.max_tokens, prefill_step_size=args.prefill_step_size,
                       show_progress=ranks is None or ranks.rank == 0, **decode_settings(args))
    except KeyboardInterrupt:
        print("\n[interrupted]", file=sys.stderr)
        return 130
    except (ValueError, OSError, DistributedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        return repl(session, interactive=sys.stdin.isatty(), ranks=ranks)
    except KeyboardInterrupt:  # only under a group: the other ranks end as this one leaves
        print(f"\n[interrupted: Ctrl-C ends every rank under {ranks.switch}]", file=ranks.err,
              flush=True)
        return 130
    except DistributedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:  # a collective evaluated by the decode loop lost a rank
        if not is_backend_error(e):
            raise
        print(f"error: rank {ranks.rank}: lost a rank during the reply ({e})", file=sys.stderr)
        return 1
