"""The chat page at `/` (routes.py): plain HTML, CSS and JavaScript shipped in static/, which
talk to the server's own `POST /v1/chat/completions`; no build step, nothing fetched from
elsewhere."""
