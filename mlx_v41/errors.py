"""Exception types that several layers of the package raise, kept at the bottom of the stack so
that any layer can raise them (a checkpoint's Engram table is checked in `model/`, a tokenizer
file in `chat/`)."""


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated or inconsistent; the message names it."""
