"""Where a checkpoint's tensors go when it loads: which model is built, and which tensors (and
which share of each) it reads. One process builds a `Model` and reads every tensor whole
(`WHOLE`); `mlx_v41.distributed` gives each rank of a group its own placement (a pipeline
stage's layers, a tensor-parallel rank's share of the split tensors).
"""

from __future__ import annotations

from typing import Optional

from ..model.model import Model
from .slicing import Shard


class Placement:
    """One process: a `Model`, every tensor read whole."""

    # True: a tensor whose parameter the built model lacks (another rank's layer) is left
    # unread; False: such a tensor is an error (the strict load).
    is_partial = False

    def build(self, args, **options):
        """The model the tensors load into, from the config and `load_model`'s options."""
        return Model(args, **options)

    def shard(self, target: str) -> Optional[Shard]:
        """This process's share of `target` (a module path or a plain parameter's name);
        None: the whole tensor."""
        return None


WHOLE = Placement()
