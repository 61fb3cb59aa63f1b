"""`mlx_v41.server`: the OpenAI-compatible HTTP server (mlx-lm's server flags where they exist).

    mlx_v41.server --model demo
    mlx_v41.server --model path/to/DeepSeek-V4.1-Flash --prompt-cache-dir ~/.cache/mlx_v41/prompts
    mlx_v41.server --model path/to/DeepSeek-V4.1-Flash --dspark --port 8081
    mlx.launch -n 2 --python $(which python) -- -m mlx_v41.server --model PATH --pipeline
    MLX_V41_API_KEY=sk-team mlx_v41.server --model PATH --host 0.0.0.0

It listens at once and loads the model after (`GET /health`: 503 {"status": "loading"},
then 200); SIGTERM or Ctrl-C drains it (a second one ends the replies at once) and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Optional

from .. import sizes
from .args import ArgumentParser, _number, add_model_arguments, load_options, report_experts
from ..distributed.cli import add_distributed_arguments, distributed_loader
from ..server.auth import KEY_ENV, read_keys
from ..server.images import DEFAULT_MAX_IMAGE_BYTES
from ..server.lifecycle import DEFAULT_DRAIN_SECONDS
from ..server.responses.store import DEFAULT_MAX_STORED_RESPONSES, ResponseStore
from ..server.serving import DEFAULT_KEEPALIVE_SECONDS, DEFAULT_MAX_TOKENS

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8080  # mlx-lm's: loopback unless asked
DEFAULT_PROMPT_CACHE_BYTES = "4G"
DEFAULT_MAX_CONCURRENT = 64
DEFAULT_DECODE_CONCURRENCY, DEFAULT_PROMPT_CONCURRENCY = 32, 8  # mlx-lm's server defaults
SHUTDOWN_GRACE_SECONDS = 4  # after a drain, connections get this long to close
POLL_SECONDS = 0.2


def parse_size(text: str) -> int:
    """Bytes from a size (`mlx_v41.sizes`: "4G", "512MiB", "1e9"), 0 included."""
    try:
        return sizes.parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def writable_folder(text: str) -> str:
    """A folder the server can create or write (checked at startup, made when the server
    starts): an existing folder it may read and write, or a new one below a writable folder."""
    path = Path(text)
    existing = next(p for p in (path, *path.parents) if p.exists())  # "." ends a relative one
    where = repr(text) if existing == path else f"{text!r}: {existing}"
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"{where} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK | (os.R_OK if existing == path else 0)):
        raise argparse.ArgumentTypeError(f"{where} is not writable")
    return text


def setup_arg_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="mlx_v41.server",
                            description="OpenAI-compatible server for DeepSeek V4.1 Flash.")
    add_model_arguments(parser, DEFAULT_MAX_TOKENS, None)
    add = parser.add_argument
    add("--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST})")
    add("--port", type=_number(int, 0, 65535, what="a port number"), default=DEFAULT_PORT,
        help=f"port (default {DEFAULT_PORT})")
    add("--api-key", action="append", default=[], metavar="KEY",
        help="a key every route but /health asks for (`Authorization: Bearer KEY` or "
             f"`x-api-key: KEY`); repeat for several; also from {KEY_ENV} (comma-separated) "
             "and --api-key-file (default: none, no check)")
    add("--api-key-file", metavar="PATH",
        help="a file of keys, one a line (blank lines and # comments skipped)")
    add("--allowed-origins", action="append", default=[], metavar="ORIGIN",
        help="a browser origin allowed to call the server (CORS), e.g. "
             "https://app.example.com; repeat for several; * allows any (default: none, "
             "CORS off)")
    add("--no-web", dest="web", action="store_false",
        help="serve no chat page at / (default: the page, which asks for the API key when "
             "the server has keys)")
    add("--prompt-cache-bytes", type=parse_size, default=parse_size(DEFAULT_PROMPT_CACHE_BYTES),
        help="bytes of cached prompt prefixes kept in memory, least recently used dropped "
             f"first (default {DEFAULT_PROMPT_CACHE_BYTES}; 0 turns reuse off; across "
             "ranks, on each rank)")
    add("--prompt-cache-dir", type=writable_folder, default=None,
        help="folder mirroring the prompt caches on disk: entries are written after each "
             "reply and loaded at start (only those of this checkpoint, config and "
             "--prefill-mode / --dspark; across ranks each rank keeps its share in its "
             "own DIR)")
    add("--max-concurrent-requests", type=_number(int, 1, what="a positive integer"),
        default=DEFAULT_MAX_CONCURRENT,
        help="requests queued or running at most; more get HTTP 429 "
             f"(default {DEFAULT_MAX_CONCURRENT})")
    add("--decode-concurrency", type=_number(int, 1, what="a positive integer"),
        default=DEFAULT_DECODE_CONCURRENCY,
        help="most sequences decoding together in one batch (default "
             f"{DEFAULT_DECODE_CONCURRENCY}; 1 serves one request at a time, batched steps)")
    add("--prompt-concurrency", type=_number(int, 1, what="a positive integer"),
        default=DEFAULT_PROMPT_CONCURRENCY,
        help="most prompts prefilled at once, chunk by chunk between decode steps (default "
             f"{DEFAULT_PROMPT_CONCURRENCY})")
    add("--decode-prefill-budget", type=_prefill_budget, default="auto",
        help="prompt tokens a step reads while replies decode: auto (about one decode step's "
             "time, so a long prompt keeps the replies' token gaps bounded), a number, or off "
             "(one --prefill-step-size chunk a step, the CED halo in one piece) (default auto)")
    add("--prefill-thread", action="store_true",
        help="read long prompts on a thread of their own while replies decode, so a decode "
             "step never waits for their work; short ones are read in the steps (the same "
             "tokens; one process with resident experts; docs/batching.md)")
    add("--kv-budget", type=parse_size, default=None,
        help="bytes the running sequences' caches may take together, each counted at its "
             "prompt + max_tokens; a request waits until it fits (default: 90%% of the "
             "machine's memory beside the weights and --prompt-cache-bytes)")
    add("--max-prompt-tokens", type=_number(int, 1, what="a positive integer"), default=None,
        help="longest prompt accepted, in tokens; longer ones get HTTP 400 before any work "
             "(default: the model's context)")
    add("--serial", action="store_true",
        help="serve one request after another (the engine before batching; several ranks "
             "always do)")
    add("--max-image-bytes", type=parse_size, default=DEFAULT_MAX_IMAGE_BYTES,
        help="decoded bytes of one image part at most; larger ones get HTTP 400 "
             f"(default {DEFAULT_MAX_IMAGE_BYTES // 10**6}MB)")
    add("--keepalive-seconds", type=_number(float, 0, what="a non-negative number"),
        default=DEFAULT_KEEPALIVE_SECONDS,
        help="a stream sends a keepalive (an SSE comment; Anthropic's ping event) after this "
             f"many seconds without an event, e.g. during a long prefill (default "
             f"{DEFAULT_KEEPALIVE_SECONDS:g}; 0 turns them off)")
    add("--max-stored-responses", type=_number(int, 0, what="a non-negative integer"),
        default=DEFAULT_MAX_STORED_RESPONSES,
        help="Responses API responses kept for previous_response_id and GET, least recently "
             f"used dropped first (default {DEFAULT_MAX_STORED_RESPONSES}; 0 keeps none)")
    add("--drain-seconds", type=_number(float, 0, what="a non-negative number"),
        default=DEFAULT_DRAIN_SECONDS,
        help="on SIGTERM or Ctrl-C, replies under way get this long to finish (new requests "
             "get 503), then end with an error; a second signal ends them at once "
             f"(default {DEFAULT_DRAIN_SECONDS:g})")
    add("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level (default INFO; across ranks, DEBUG has every rank log its "
             "requests)")
    add_distributed_arguments(parser)
    return parser


def build_app(args, keys=(), loader=None):
    """Load the model (with `loader`, `distributed_loader`'s, across ranks) and make the app
    (the engine starts with the app)."""
    import mlx.core as mx

    from ..checkpoint.source import load
    from ..generation.group import ONE_PROCESS
    from ..server.engine import Engine
    from ..server.engine.prompt_store import PromptCacheStore
    from ..server.app import create_app
    from ..server.serving import ServerConfig

    model, tokenizer = (loader or load)(args.model, prefill_mode=args.prefill_mode,
                                        dspark=args.dspark, head_dtype=args.head_dtype,
                                        **load_options(args))
    report_experts(model)
    if args.seed is not None:
        mx.random.seed(args.seed)
    kind, group, batching = Engine, ONE_PROCESS, {}
    if loader:
        from ..server.engine.ranks import Follower, GroupEngine

        group = model.group
        kind = GroupEngine if group.link.rank == 0 else Follower
    elif not args.serial:
        from ..server.engine.batch import BatchEngine

        kind = BatchEngine
        batching = {"decode_concurrency": args.decode_concurrency,
                    "prompt_concurrency": args.prompt_concurrency, "kv_budget": args.kv_budget,
                    "decode_prefill_budget": args.decode_prefill_budget,
                    "prefill_thread": args.prefill_thread}
    store = PromptCacheStore(model, args.prompt_cache_bytes, args.prompt_cache_dir, group)
    engine = kind(model, tokenizer, store, group=group,
                  prefill_step_size=args.prefill_step_size,
                  draft="dspark" if args.dspark else None,
                  num_draft_tokens=args.num_draft_tokens,
                  draft_confidence=args.draft_confidence,
                  max_concurrent=args.max_concurrent_requests, **batching)
    config = ServerConfig(model_id=args.model, max_tokens=args.max_tokens, temp=args.temp,
                          top_p=args.top_p, min_p=args.min_p, top_k=args.top_k,
                          thinking=args.thinking, reasoning_effort=args.reasoning_effort,
                          system_prompt=args.system_prompt,
                          max_image_bytes=args.max_image_bytes,
                          max_prompt_tokens=args.max_prompt_tokens,
                          keepalive_seconds=args.keepalive_seconds, web=args.web)
    app = create_app(engine, config, api_keys=keys, allowed_origins=args.allowed_origins)
    app.state.responses = ResponseStore(args.max_stored_responses)
    return app


def main(argv: Optional[list] = None) -> int:
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    try:
        keys = read_keys(args.api_key, args.api_key_file)
    except ValueError as e:
        parser.error(str(e))
    if args.prefill_thread and (args.serial or args.pipeline or args.tensor_parallel):
        parser.error("--prefill-thread needs the batch engine in one process: not with --serial, "
                     "--pipeline or --tensor-parallel")
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(message)s")
    from ..checkpoint.source import resolve_model_path
    from ..distributed.link import DistributedError
    from ..server.engine.ranks import Follower

    if not keys and not is_loopback(args.host) and launched_rank() == 0:
        print(f"mlx_v41.server: warning: --host {args.host} without an API key: anyone who "
              f"reaches port {args.port} can use the model (set --api-key or {KEY_ENV})",
              file=sys.stderr)
    app = None
    try:
        loader = distributed_loader(args)
        if loader:  # the ranks load together before rank 0 listens
            app = build_app(args, keys, loader)
        else:  # one line for a missing folder before anything listens
            resolve_model_path(args.model)
    except (ValueError, OSError, DistributedError) as e:  # CheckpointError, ConfigError, ...
        print(f"mlx_v41.server: error: {e}", file=sys.stderr)
        return 1
    if app is not None and isinstance(app.state.engine, Follower):  # no HTTP on this rank
        if args.log_level != "DEBUG":  # rank 0 logs requests; DEBUG: every rank does
            logging.getLogger("mlx_v41.server").setLevel(logging.WARNING)
        return follow(app.state.engine)
    return serve(args, keys, app)


def launched_rank() -> int:
    """This process's rank as `mlx.launch` (or MPI) set it before any group starts: 0 when
    launched alone (the rank that listens)."""
    for name in ("MLX_RANK", "OMPI_COMM_WORLD_RANK"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


class _Stopped(BaseException):
    """A stop signal came while the model was loading (a BaseException, as KeyboardInterrupt:
    no `except Exception` of the load takes it)."""


def serve(args, keys, app=None) -> int:
    """Listen at once (`create_loading_app` answers), load the model on this thread unless
    `app` is given (loaded across ranks), serve the app until a stop signal drains it."""
    import uvicorn

    from ..distributed.link import DistributedError
    from ..server.app import create_loading_app
    from ..server.lifecycle import Swap

    swap = Swap(create_loading_app(keys, args.allowed_origins))
    server = uvicorn.Server(uvicorn.Config(swap, host=args.host, port=args.port,
                                           log_level=args.log_level.lower(),
                                           timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS))
    stops = _Stops(server, args.drain_seconds)
    thread = threading.Thread(target=_listen, args=(server,), name="mlx_v41-http", daemon=True)
    status = 0
    with stops.handling():
        try:
            thread.start()
            while not server.started and thread.is_alive():
                thread.join(POLL_SECONDS / 4)
            if not server.started:  # uvicorn logged why (the address is in use, ...)
                print(f"mlx_v41.server: error: cannot listen on {args.host}:{args.port}",
                      file=sys.stderr)
                return 1
            app = app or build_app(args, keys)
            asyncio.run_coroutine_threadsafe(swap.swap(app), swap.loop).result()
            stops.serving(app)
        except _Stopped:
            logging.getLogger("mlx_v41.server").info("stopped while loading the model")
        except (ValueError, OSError, DistributedError) as e:
            print(f"mlx_v41.server: error: {e}", file=sys.stderr)
            server.should_exit, status = True, 1
        stops.is_loading = False
        while thread.is_alive():
            thread.join(POLL_SECONDS)
    if status == 0:
        print("mlx_v41.server: shut down", file=sys.stderr)
    return status


def _listen(server) -> None:
    try:
        server.run()
    except SystemExit:  # uvicorn's exit when it cannot listen (it logged why)
        pass


class _Stops:
    """What SIGINT and SIGTERM do (handled on the main thread; uvicorn runs on another, so it
    neither takes them nor raises them again at its end: the exit status is 0): while the
    model loads, stop; then the first one drains the app (`--drain-seconds`), the second ends
    its replies at once, a third stops uvicorn without waiting for connections."""

    def __init__(self, server, seconds: float):
        self.server, self.seconds = server, seconds
        self.app, self.count, self.is_loading = None, 0, True

    @contextlib.contextmanager
    def handling(self):
        signals = (signal.SIGINT, signal.SIGTERM)
        before = {sig: signal.signal(sig, self.handle) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)

    def serving(self, app) -> None:
        app.state.lifecycle.on_drained = self.exit
        self.app, self.is_loading = app, False

    def exit(self) -> None:
        self.server.should_exit = True

    def handle(self, sig, frame) -> None:
        self.count += 1
        if self.app is None:  # not serving yet: stop (a load stops here)
            self.exit()
            if self.is_loading:
                raise _Stopped
            return
        lifecycle = self.app.state.lifecycle
        if self.count == 1:
            asyncio.run_coroutine_threadsafe(lifecycle.drain(self.seconds), lifecycle.loop)
        elif self.count == 2:
            lifecycle.hurry()
        else:
            self.server.force_exit = True
            self.exit()


def follow(engine) -> int:
    """Run rank 0's requests until its server stops (or it is lost: one line)."""
    from ..distributed.link import DistributedError

    try:
        engine.follow()
    except DistributedError as e:
        print(f"mlx_v41.server: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())


def _prefill_budget(text: str):
    """--decode-prefill-budget: "auto", a positive number of tokens, or "off" (None)."""
    if text in ("auto", "off"):
        return None if text == "off" else text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not auto, off or a positive integer")
    return value
