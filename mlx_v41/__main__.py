"""`python -m mlx_v41 <command> ...`: generate, chat, inspect, convert, demo, server,
perplexity, compare, launch."""

import importlib
import sys

COMMANDS = {
    "generate": "mlx_v41.cli.generate",
    "chat": "mlx_v41.cli.chat",
    "inspect": "mlx_v41.cli.inspect",
    "convert": "mlx_v41.convert.cli",
    "demo": "mlx_v41.cli.demo",
    "server": "mlx_v41.cli.server",
    "perplexity": "mlx_v41.cli.perplexity",
    "compare": "mlx_v41.cli.compare",
    "launch": "mlx_v41.cli.launch",
}
USAGE = f"usage: python -m mlx_v41 {{{','.join(COMMANDS)}}} [options]  (options: <command> --help)"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"python -m mlx_v41: error: unknown command {command!r}\n{USAGE}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(COMMANDS[command])
    except ModuleNotFoundError as e:
        print(f"python -m mlx_v41: error: {command} is not available ({e})", file=sys.stderr)
        return 2
    sys.argv = [f"mlx_v41.{command}", *rest]
    return module.main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
