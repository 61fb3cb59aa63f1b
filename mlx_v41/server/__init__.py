"""The OpenAI-compatible server: request models (`protocol`), V4.1 semantics of a request
(`messages`) and of a reply (`reply_parser`), the engine that serialises generation on one
model (`engine`), its prompt-cache LRU (`prompt_store`), and the FastAPI app (`routes`).
"""

from .engine import Engine
from .prompt_store import PromptCacheStore
from .routes import ServerConfig, create_app

__all__ = ["Engine", "PromptCacheStore", "ServerConfig", "create_app"]
