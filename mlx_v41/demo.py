"""`python -m mlx_v41.demo`; the command lives in `mlx_v41.cli.demo`."""

import sys

from .cli.demo import main

if __name__ == "__main__":
    sys.exit(main())
