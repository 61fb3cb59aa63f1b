"""What runs the model for the routes: the one-at-a-time `Engine` (serial.py), the batching
`BatchEngine` (batch.py), the ranks of a distributed server (ranks.py) and the prompt-cache
store they share (prompt_store.py)."""

from .prompt_store import PromptCacheStore
from .serial import Engine, EngineBusy, EngineClosed, Finish, Job, Settings, StopStrings, Token

__all__ = ["Engine", "EngineBusy", "EngineClosed", "Finish", "Job", "PromptCacheStore",
           "Settings", "StopStrings", "Token"]
