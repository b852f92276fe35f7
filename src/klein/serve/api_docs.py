"""The OpenAPI docs of `klein serve`: GET /docs (Swagger UI) and its files under /static/docs/.

FastAPI's own /docs loads Swagger UI from a CDN, so offline or behind a firewall it is a blank page; this
one serves Swagger UI from the package (`swagger-ui/`, its README says the version and source). ReDoc
has no such copy here, so there is no /redoc. The files hold no data, so they need no API key (they are
under /static/); /docs and /openapi.json need it as the API does.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, HTTPException, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, Response

from klein.serve.page import HEADERS

ASSETS = {
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "favicon-32x32.png": "image/png",
}

router = APIRouter(include_in_schema=False)


@router.get("/docs")
def docs(request: Request) -> HTMLResponse:
    # Relative URLs, as the web page's: they resolve against the address /docs was loaded from.
    return get_swagger_ui_html(
        openapi_url=request.app.openapi_url.removeprefix("/"),
        title=f"{request.app.title} - Swagger UI",
        swagger_js_url="static/docs/swagger-ui-bundle.js",
        swagger_css_url="static/docs/swagger-ui.css",
        swagger_favicon_url="static/docs/favicon-32x32.png",
    )


@router.get("/static/docs/{name}")
def swagger_file(name: str) -> Response:
    if name not in ASSETS:
        raise HTTPException(404, f"no docs file {name!r}; the docs have {', '.join(sorted(ASSETS))}")
    body = (resources.files("klein.serve") / "swagger-ui" / name).read_bytes()
    return Response(body, media_type=ASSETS[name], headers=HEADERS)
