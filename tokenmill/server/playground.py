"""The web playground: `GET /` serves one page, `GET /ui/<file>` its scripts and styles, all from
tokenmill/server/static inside the package (no build step, no CDN, so it works offline).

The page itself is open, like /health: it holds no data. Every API call it makes goes through
the same routes and API key as any other client.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import PurePath

from fastapi import APIRouter
from fastapi.responses import Response

from tokenmill.server.errors import APIError

STATIC = files("tokenmill.server") / "static"
PAGE = "index.html"
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
}
"""Set here rather than guessed from the platform's MIME table, which varies (a module script
served as text/plain is refused by the browser)."""


def static_files() -> dict[str, str]:
    """Every servable file's name and content type: only these names can be asked for, so no
    path reaches outside the static folder."""
    result = {}
    for entry in STATIC.iterdir():
        suffix = PurePath(entry.name).suffix
        if entry.is_file() and suffix in CONTENT_TYPES:
            result[entry.name] = CONTENT_TYPES[suffix]
    return result


def playground_routes() -> APIRouter:
    router = APIRouter()
    served = static_files()

    def serve(name: str) -> Response:
        if name not in served:
            raise APIError(404, f"no such file: {name}", code="not_found")
        # no-cache: the browser revalidates, so a newer tokenmill's page is never mixed with
        # an older one's scripts.
        body = (STATIC / name).read_bytes()
        return Response(body, media_type=served[name], headers={"Cache-Control": "no-cache"})

    @router.get("/", include_in_schema=False)
    async def page() -> Response:
        return serve(PAGE)

    @router.get("/ui/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        return serve(name)

    return router
