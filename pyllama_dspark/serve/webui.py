"""The web page (``GET /``, as llama-server serves its web UI): a chat that shows, token by token,
what the drafter got right (:mod:`.trace`), and compares a reply with one decoded without a draft.

Every asset ships inside the package (``webui/``: the page, its script and style, and the vendored
browser libraries under ``webui/vendor/`` with their licenses), so the page works offline.  The
page and its assets load without the API key, as llama-server's do; the page asks for the key when
an API call answers 401.  ``serve --no-webui`` leaves ``/`` a 404.
"""

from __future__ import annotations

import mimetypes
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import FileResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

WEBUI_DIR = Path(__file__).resolve().parent / "webui"

_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
          ".html": "text/html; charset=utf-8"}


def asset(path: str) -> Path:
    """The file of ``/webui/<path>`` inside the package; a 404 for anything else (no way out of it)."""
    f = (WEBUI_DIR / path).resolve()
    if WEBUI_DIR not in f.parents or not f.is_file():
        raise StarletteHTTPException(404, f"File Not Found: /webui/{path}")
    return f


def add_webui_routes(app: Any) -> None:
    """``GET /`` (and ``/index.html``) the page, ``GET /webui/<path>`` its assets."""

    async def page(request: Request):
        return FileResponse(WEBUI_DIR / "index.html", media_type=_TYPES[".html"],
                            headers={"Cache-Control": "no-cache"})

    async def static(path: str):
        f = asset(path)
        kind = _TYPES.get(f.suffix) or mimetypes.guess_type(f.name)[0] or "application/octet-stream"
        return FileResponse(f, media_type=kind, headers={"Cache-Control": "no-cache"})

    app.add_api_route("/", page, methods=["GET"])
    app.add_api_route("/index.html", page, methods=["GET"])
    app.add_api_route("/webui/{path:path}", static, methods=["GET"])
