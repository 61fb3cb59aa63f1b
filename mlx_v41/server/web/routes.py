"""The chat page: `GET /` and its two assets, read once from the package's static/ folder.
They stay outside the OpenAPI schema (they are no API) and outside the key check (`PATHS`):
the page loads, then asks for the key when the API answers 401. A Content-Security-Policy
lets the page reach its own server only.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

STATIC = resources.files(__package__) / "static"
PAGES = {"/": ("index.html", "text/html; charset=utf-8"),
         "/web/app.js": ("app.js", "text/javascript; charset=utf-8"),
         "/web/style.css": ("style.css", "text/css; charset=utf-8")}
PATHS = frozenset(PAGES)  # open without an API key
# Images are attached as data: URLs; everything else comes from this server.
POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
          "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
           "Content-Security-Policy": POLICY}


def add_routes(app: FastAPI) -> None:
    for path, (name, media_type) in PAGES.items():
        app.add_api_route(path, _file(name, media_type), methods=["GET"],
                          include_in_schema=False)


def _file(name: str, media_type: str):
    body = (STATIC / name).read_bytes()

    async def serve():
        return Response(body, media_type=media_type, headers=HEADERS)

    return serve
