"""`python -m mlx_v41.server`."""

import sys

from ..cli.server import main

sys.exit(main())
