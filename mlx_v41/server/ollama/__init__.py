"""Ollama's API: request and reply bodies (protocol.py), what it says of the served model
(models.py) and routes (routes.py: NDJSON streams, errors as `{"error": "..."}`)."""
