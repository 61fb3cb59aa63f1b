"""`python -m mlx_v41.inspect`; the command lives in `mlx_v41.cli.inspect`."""

import sys

from .cli.inspect import main

if __name__ == "__main__":
    sys.exit(main())
