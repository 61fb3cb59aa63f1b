"""`python -m mlx_v41.launch`; the command lives in `mlx_v41.cli.launch`."""

import sys

from .cli.launch import main

if __name__ == "__main__":
    sys.exit(main())
