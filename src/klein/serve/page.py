"""The editing page of `klein serve`: GET / and its static files, nothing fetched from elsewhere (it works
offline); it holds no data, so it needs no API key."""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, HTTPException
from fastapi.responses import Response

JS = "text/javascript; charset=utf-8"
MODULES = "app api dom errors progress references results settings storage mask loras warmup".split()
"""The page's ES modules, one concept each; app.js imports the others."""
ASSETS = {"index.html": "text/html; charset=utf-8", "style.css": "text/css; charset=utf-8"}
ASSETS |= {f"{module}.js": JS for module in MODULES}
# The files change with the installed version only; revalidating keeps an upgraded server's page fresh.
HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}

router = APIRouter(include_in_schema=False)


def asset(name: str, assets: dict[str, str] = ASSETS, folder: str = "static") -> Response:
    """A file of the package's `folder`, as `assets` types it."""
    body = (resources.files("klein.serve") / folder / name).read_bytes()
    return Response(body, media_type=assets[name], headers=HEADERS)


@router.api_route("/", methods=["GET", "HEAD"])  # HEAD: as GET, the server sends no body
def index() -> Response:
    return asset("index.html")


@router.get("/static/{name}")
def static_file(name: str) -> Response:
    if name not in ASSETS or name == "index.html":
        raise HTTPException(404, f"no page file {name!r}; the page has {', '.join(sorted(ASSETS))}")
    return asset(name)
