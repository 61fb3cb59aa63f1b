"""OpenAI's chat completions and completions API: request models (protocol.py), messages in
the chat format's terms (messages.py), response bodies and stream chunks (bodies.py), routes."""
