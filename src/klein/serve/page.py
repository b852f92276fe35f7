"""The editing page of `klein serve`: GET / and its static files (HTML, CSS, JavaScript modules).

No build step and nothing fetched from elsewhere (no CDN, fonts or scripts), so the page works offline
and behind a firewall. It holds no data, so it needs no API key; the page sends the key on API calls.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, HTTPException
from fastapi.responses import Response

JS = "text/javascript; charset=utf-8"
ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    # ES modules, one concept each; app.js imports the others.
    "app.js": JS,
    "api.js": JS,
    "dom.js": JS,
    "errors.js": JS,
    "progress.js": JS,
    "references.js": JS,
    "results.js": JS,
    "settings.js": JS,
    "storage.js": JS,
    "mask.js": JS,
    "loras.js": JS,
    "warmup.js": JS,
}
# The files change with the installed version only; revalidating keeps an upgraded server's page fresh.
HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}

router = APIRouter(include_in_schema=False)


def _asset(name: str) -> Response:
    body = (resources.files("klein.serve") / "static" / name).read_bytes()
    return Response(body, media_type=ASSETS[name], headers=HEADERS)


@router.get("/")
def index() -> Response:
    return _asset("index.html")


@router.get("/static/{name}")
def static_file(name: str) -> Response:
    if name not in ASSETS or name == "index.html":
        raise HTTPException(404, f"no page file {name!r}; the page has {', '.join(sorted(ASSETS))}")
    return _asset(name)
