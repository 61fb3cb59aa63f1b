"""`python -m mlx_v41.generate` (mlx-lm's spelling); the command lives in `mlx_v41.cli.generate`."""

import sys

from .cli.generate import main

if __name__ == "__main__":
    sys.exit(main())
