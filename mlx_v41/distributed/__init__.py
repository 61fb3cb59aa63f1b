"""Several machines as one model over `mx.distributed` (ring, JACCL, MPI), launched with
`mlx.launch`: pipeline parallel stages (`pipeline.py`), the split and what crosses each boundary
(`split.py`), the transfers (`link.py`) and the startup handshake (`startup.py`)."""
