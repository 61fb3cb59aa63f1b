"""`python -m mlx_v41.chat`."""

import sys

from ..cli.chat import main

sys.exit(main())
