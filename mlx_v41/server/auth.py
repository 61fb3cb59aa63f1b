"""API keys and CORS, as middleware over every route: a request to any path but `GET /health`
(and the chat page's files: the page asks for the key) must carry one of the server's keys, as
OpenAI's clients send it (`Authorization: Bearer KEY`) or as Anthropic's do (`x-api-key:
KEY`); browsers' cross-origin requests are allowed only from the origins named (Starlette's
`CORSMiddleware`, outside the key check so that a preflight, which carries no key, is
answered).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path
from typing import Callable, Iterable, Optional

from starlette.middleware.cors import CORSMiddleware

OPEN_PATHS = frozenset({"/health"})  # what a load balancer probes: no key needed
KEY_ENV = "MLX_V41_API_KEY"  # the server's keys from the environment, comma-separated
BEARER = b"bearer "
MISSING = ("no API key: send one as `Authorization: Bearer KEY` (or Anthropic's "
           "`x-api-key: KEY`)")
WRONG = "the API key is not valid"


def _digest(key: bytes) -> bytes:
    # Digests compare in constant time whatever the lengths: a wrong key's length stays hidden.
    return hashlib.sha256(key).digest()


def presented_keys(headers: Iterable[tuple]) -> list:
    """The keys a request carries (raw ASGI headers): a Bearer token and an x-api-key."""
    keys = []
    for name, value in headers:
        if name == b"authorization" and value[:len(BEARER)].lower() == BEARER:
            keys.append(value[len(BEARER):].strip())
        elif name == b"x-api-key":
            keys.append(value.strip())
    return keys


class APIKeys:
    """ASGI middleware: an HTTP request to a path other than `open_paths` passes with one of
    `keys`, else it gets `refuse(scope, message)` (a 401 response in the API's shape)."""

    def __init__(self, app, keys: Iterable[str], refuse: Callable, open_paths=OPEN_PATHS):
        self.app, self.refuse, self.open_paths = app, refuse, open_paths
        self.digests = [_digest(key.encode()) for key in keys]

    def is_allowed(self, headers) -> bool:
        """Whether a key presented is one of ours: every key against every one of ours, with
        no early exit (the time taken does not depend on which one matched)."""
        allowed = False
        for key in presented_keys(headers):
            digest = _digest(key)
            for ours in self.digests:
                allowed |= hmac.compare_digest(digest, ours)
        return allowed

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open_paths or \
                self.is_allowed(scope["headers"]):
            return await self.app(scope, receive, send)
        message = WRONG if presented_keys(scope["headers"]) else MISSING
        await self.refuse(scope, message)(scope, receive, send)


def add_keys(app, keys: Iterable[str], refuse: Callable, open_paths=OPEN_PATHS) -> None:
    """Check `keys` (none: no check) on `app`'s requests to paths other than `open_paths`,
    outside its middleware so far."""
    keys = list(keys)
    if keys:
        app.add_middleware(APIKeys, keys=keys, refuse=refuse, open_paths=open_paths)


def add_cors(app, allowed_origins: Iterable[str]) -> None:
    """Answer browsers' CORS for `allowed_origins` ("*": any; none: CORS off); added last, so
    outermost: a preflight, which carries no key, is answered before the key check."""
    origins = list(allowed_origins)
    if origins:
        # Keys travel in headers, never cookies: no credentials mode, any header and method.
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"],
                           allow_headers=["*"])


# ----------------------------------------------------------------------------- reading keys

def check_key(key: str, where: str) -> str:
    """`key` stripped, or ValueError naming `where`: a key is printable ASCII without spaces
    (what an HTTP header carries as it is)."""
    key = key.strip()
    if not key:
        raise ValueError(f"{where}: an empty API key")
    if not all("!" <= c <= "~" for c in key):
        raise ValueError(f"{where}: an API key must be printable ASCII without spaces")
    return key


def read_keys(flags: Iterable[str] = (), file: Optional[str] = None,
              env: Optional[dict] = None) -> list:
    """The server's keys: `--api-key` values, the lines of `--api-key-file` (blank lines and
    lines starting with # skipped) and KEY_ENV's comma-separated value, in that order, without
    repeats. ValueError (one line) for an empty key, an unreadable file or one without keys."""
    env = os.environ if env is None else env
    keys = [check_key(key, "--api-key") for key in flags]
    if file is not None:
        try:
            lines = Path(file).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--api-key-file: cannot read {file!r} ({e})") from None
        found = [line for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not found:
            raise ValueError(f"--api-key-file: {file!r} holds no key")
        keys += [check_key(line, f"--api-key-file {file!r}") for line in found]
    if KEY_ENV in env:
        keys += [check_key(key, KEY_ENV) for key in env[KEY_ENV].split(",")]
    return list(dict.fromkeys(keys))
