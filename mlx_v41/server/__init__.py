"""The server: one FastAPI app (app.py) over one engine (engine/: serial, batching, ranks, the
prompt-cache store), with each API in its own package (openai/: chat completions and
completions; responses/: the Responses API; anthropic/: Messages; ollama/: Ollama's API).
The pieces every API shares sit here: request errors and bodies (errors.py, bodies.py), a
conversation's thinking mode and answer format (conversation.py), constraints and logits
processors (constraints.py, processors.py), the reply parser (reply_parser.py), images
(images.py) and what routes share (serving.py: settings, rendering a chat, submitting, streams,
awaiting).
"""

from .app import create_app
from .engine import Engine, PromptCacheStore
from .serving import ServerConfig

__all__ = ["Engine", "PromptCacheStore", "ServerConfig", "create_app"]
