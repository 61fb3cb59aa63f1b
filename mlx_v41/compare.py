"""`python -m mlx_v41.compare`; the command lives in `mlx_v41.cli.compare`."""

import sys

from .cli.compare import main

if __name__ == "__main__":
    sys.exit(main())
