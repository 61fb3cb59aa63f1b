"""`python -m mlx_v41.perplexity`; the command lives in `mlx_v41.cli.perplexity`."""

import sys

from .cli.perplexity import main

if __name__ == "__main__":
    sys.exit(main())
