"""Anthropic's Messages API: request models (protocol.py) and routes (with its own error
shape and SSE events)."""
