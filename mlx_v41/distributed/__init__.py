"""Several machines as one model over `mx.distributed` (ring, JACCL, MPI), launched with
`mlx.launch`: pipeline parallel stages (`pipeline.py`), tensor parallel shares of every layer
(`tensor.py`), the pipeline's split and what crosses each boundary
(`split.py`), the transfers (`link.py`) and the startup handshake (`startup.py`)."""
