"""`mlx_v41.chat`: the chat REPL over a `ChatSession` (commands, Ctrl-C, scripted stdin; line
editing, history and multi-line messages in `chat_input`, the reasoning shown apart in
`reasoning`).

    mlx_v41.chat --model demo
    mlx_v41.chat --model path/to/DeepSeek-V4.1-Flash --no-thinking
    mlx_v41.chat --model path/to/DeepSeek-V4.1-Flash --dspark --num-draft-tokens 3
    mlx.launch -n 2 --python $(which python) -- -m mlx_v41.chat --model PATH --pipeline
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from .args import (ArgumentParser, add_hide_thinking_argument, add_model_arguments,
                   decode_settings, load_options, report_experts)
from .chat_input import BLOCK, StreamLines, read_message, stream_readline, terminal_lines
from .reasoning import ReplyPrinter
from ..checkpoint.source import load
from ..chat.session import DEFAULT_MAX_TOKENS, ChatSession, format_stats
from ..distributed.chat import SharedChatSession
from ..distributed.cli import add_distributed_arguments, distributed_loader
from ..distributed.link import DistributedError, is_backend_error
from ..generation.group import ONE_PROCESS


DEFAULT_SEED = 0


HELP = f"""commands:
  /help (h)               this list
  /reset (r)              start a new conversation
  /save PATH              save the session (prompt cache + transcript)
  /load PATH              load a saved session
  /stats                  statistics of the last turn
  /image PATH             attach an image (path, URL or data: URI) to the next message
  /thinking [on|off]      toggle thinking mode
  /reasoning [show|hide]  show or hide the reasoning of thinking-mode replies
  /dspark [on|off]        toggle DSpark speculative decoding (needs --dspark)
  /quit (q)               leave (also Ctrl-D); Ctrl-C stops a reply
a line starting with {BLOCK} opens a multi-line message, a line ending with {BLOCK} sends it;
arrow keys, Ctrl-R: line editing and the history (where Python has readline)"""


# The arguments of the switches (none: toggle).
SWITCHES = {"/thinking": ("on", "off"), "/dspark": ("on", "off"),
            "/reasoning": ("show", "hide")}


@dataclass
class View:
    """How replies are shown: the reasoning or not; ANSI styles (None: on a terminal)."""

    show_reasoning: bool = True
    styled: Optional[bool] = None


@dataclass
class Ranks:
    """The REPL run by every rank of a `--pipeline` / `--tensor-parallel` group: rank 0's lines
    reach every rank (`readline`), errors print on rank 0 only (`err`)."""

    readline: Callable[[], Optional[str]]
    err: object
    switch: str
    rank: int


def run_command(session: ChatSession, line: str, out, err=None,
                view: Optional[View] = None) -> bool:
    """Carry out a /command; False means quit."""
    err, view = err or sys.stderr, view or View()
    name, _, arg = line.partition(" ")
    name, arg = {"q": "/quit", "r": "/reset", "h": "/help"}.get(name, name), arg.strip()
    if name in ("/quit", "/exit"):
        return False
    if name == "/help":
        print(HELP, file=out)
    elif name == "/reset":
        session.reset()
        print("[new conversation]", file=out)
    elif name in SWITCHES and arg not in ("", *SWITCHES[name]):
        print(f"error: {name} takes {' or '.join(SWITCHES[name])} (nothing: toggle), not "
              f"{arg!r}", file=err)
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
    elif name == "/thinking":
        session.thinking = {"on": True, "off": False}.get(arg, not session.thinking)
        print(f"[thinking {'on' if session.thinking else 'off'}]", file=out)
    elif name == "/reasoning":
        view.show_reasoning = {"show": True, "hide": False}.get(arg, not view.show_reasoning)
        print(f"[reasoning {'shown' if view.show_reasoning else 'hidden'}]", file=out)
    elif name == "/dspark":
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


def repl(session: ChatSession, interactive: bool, out=None, stream=None,
         ranks: Optional[Ranks] = None, lines=None, view: Optional[View] = None) -> int:
    """Read messages and /commands until /quit, end of input or Ctrl-C at the prompt, from
    `lines` (`chat_input.TerminalLines`; default: `stream`, stdin, read a line at a time).
    Under `ranks` every rank runs it on rank 0's lines, and Ctrl-C during a reply is raised (it
    ends every rank: the others are inside the reply's collectives)."""
    out, view = out or sys.stdout, view or View()
    err = ranks.err if ranks else sys.stderr
    if ranks or lines is None:
        lines = StreamLines(ranks.readline if ranks else stream_readline(stream or sys.stdin),
                            out)
    if interactive:
        ctrl_c = f"Ctrl-C ends every rank ({ranks.switch})" if ranks else "Ctrl-C stops a reply"
        print(f"mlx_v41.chat: /help lists the commands; {ctrl_c}, Ctrl-D quits.", file=out)
    while True:
        try:
            message = read_message(lines, interactive, out, err)
        except KeyboardInterrupt:
            message = None
        if message is None:
            print(file=out)
            return 0
        if not message.text:
            continue
        try:
            if not message.is_block and (message.text.startswith("/") or
                                         message.text in ("q", "r", "h")):
                if not run_command(session, message.text, out, err, view):
                    return 0
                continue
            print_reply(session, message.text, out, view)
        except KeyboardInterrupt:
            if ranks:
                raise
            session.interrupt()
            print("\n[interrupted]", file=out, flush=True)
        except (ValueError, OSError) as e:  # bad command argument, prompt too long, bad file
            print(f"error: {' '.join(str(e).split())}", file=err, flush=True)


def print_reply(session: ChatSession, text: str, out, view: View) -> None:
    """Stream the reply to `text`, its reasoning apart from the answer (`cli.reasoning`)."""
    printer = ReplyPrinter(out, session.thinking, view.show_reasoning, view.styled)
    for response in session.reply(text):
        printer.write(response.text)
    printer.finish()
    print(file=out)


def setup_arg_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="mlx_v41.chat",
                            description="Chat with DeepSeek V4.1 Flash (multi-turn, cached).")
    add_model_arguments(parser, DEFAULT_MAX_TOKENS, DEFAULT_SEED)
    add_hide_thinking_argument(parser)
    parser.add_argument("--history-file", default=None, metavar="PATH",
                        help="on a terminal: keep the input history in PATH across sessions, "
                             "e.g. ~/.mlx_v41_history (default: in memory for this session)")
    add_distributed_arguments(parser)
    return parser


def group_ranks(args, group) -> Ranks:
    """`Ranks` for a model loaded over a group (`group`: its `RankGroup`)."""
    link = group.link
    local = stream_readline(sys.stdin) if link.rank == 0 else None
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
    lines = terminal_lines(args.history_file) if ranks is None and sys.stdin.isatty() else None
    try:
        return repl(session, interactive=sys.stdin.isatty(), ranks=ranks, lines=lines,
                    view=View(show_reasoning=not args.hide_thinking))
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
    finally:
        if lines is not None:
            lines.close()  # writes --history-file
