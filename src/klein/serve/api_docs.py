"""The OpenAPI docs of `klein serve`: GET /docs (Swagger UI from the package, not a CDN), and what the schema
says beyond the routes' signatures: the multipart bodies, the image routes' answers, this server's limits
and API key."""

from __future__ import annotations

import re

from fastapi import APIRouter, HTTPException, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, Response
from pydantic import BaseModel, Field

from klein.serve.page import asset
from klein.serve.schema import ImageBody

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
    return asset(name, ASSETS, "swagger-ui")


_FILES = {"type": "array", "items": {"type": "string", "format": "binary"}}
_IMAGE_FILES = {**_FILES, "description": "image files (PNG, JPEG, WebP), in order; also accepted as image[]"}
_MASK_FILE = {
    "type": "string",
    "format": "binary",
    "description": "inpainting: where to repaint the first image (the other images are references): "
    "OpenAI's mask, whose fully transparent pixels are repainted, or without transparency white repaints "
    "and black keeps",
}


_LORAS_FIELD = {
    "type": "string",
    "description": "LoRAs by the names GET /v1/loras lists: one as text, ink:0.8, or the JSON a body "
    'takes: ["ink:0.8", ["pen", 1], {"name": "wash", "scale": 0.5}]',
}


_CACHE_FIELD = {
    "type": "string",
    "description": 'a step cache: "on" (the recipe), "off", settings as text, threshold=0.2,warmup=4, or the '
    'JSON object a body takes: {"threshold": 0.2, "warmup": 4}',
}


def _multipart(properties: dict, required: list[str]) -> dict:
    form = {"type": "object", "properties": properties, "required": required}
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": form}}}}


def edits_body() -> dict:
    """/v1/images/edits: the files, and every field of /v1/images/generations as a form field."""
    fields = ImageBody.model_json_schema()
    required = list(fields.get("required", ()))
    properties = {"image": _IMAGE_FILES, "mask": _MASK_FILE, **fields["properties"]}
    properties |= {"loras": _LORAS_FIELD, "cache": _CACHE_FIELD}
    for name, field in properties.items():
        if name not in required and name != "image":
            # Blank in "Try it out" (which sends every field: a blank one is as if not sent), rather than
            # Swagger UI's placeholders ("string", 0), which it would send as values.
            field["example"] = ""
    return _multipart(properties, required)


def references_body() -> dict:
    return _multipart({"image": _IMAGE_FILES}, ["image"])


class ImageData(BaseModel):
    b64_json: str = Field(description="a PNG, base64; its text chunks carry the prompt, seed and settings")


class ReferencesUsed(BaseModel):
    id: str = Field(description="the reference set's id, for `references` in later requests")
    cache: str = Field(description='"hit" or "miss"')
    saved_seconds: float = Field(description="encoding time the cache saved")


class StepCacheUsed(BaseModel):
    passes: int = Field(
        description="passes of the transformer the steps asked for (steps x 2 under guidance)"
    )
    computed: dict[str, int] = Field(description="passes each block group (double, single) computed")
    cached_steps: dict[str, dict[str, list[int]]] = Field(
        description="per group, per pass (cond; uncond under guidance): the steps that reused the cache, "
        "for the request's first image (a batch's images decide apart)"
    )


class BucketsUsed(BaseModel):
    image_tokens: int = Field(description="the output image's tokens (one per 16 x 16 px)")
    reference_tokens: int = Field(description="all references' tokens together")
    bucket: list[int] = Field(
        description="what the steps ran over: [images, image stream, references stream]"
    )
    own_bucket: list[int] = Field(description="the request's own buckets, as `bucket`")
    larger: bool = Field(
        description="ran on larger warm buckets than its own, which were compiling in the background"
    )
    padded_tokens: int = Field(description="masked tokens the steps ran beside the real ones")
    compiling_behind: int = Field(description="shapes queued or compiling in the background")
    parts: int | None = Field(None, description="parts a batch of no warm size ran in (absent: whole)")


class KleinFields(BaseModel):
    seed: int
    settings: dict = Field(
        description="what ran: size, steps, guidance, strength, step cache, seed, mode, model, ..."
    )
    timings: dict[str, float] = Field(description="seconds per stage (compile apart)")
    references: ReferencesUsed | None
    step_cache: StepCacheUsed | None = Field(description="what a step cache decided (null without one)")
    buckets: BucketsUsed | None = Field(
        description="the token buckets the steps ran on (null over exact sizes or under a step cache)"
    )
    warnings: list[str] = Field(description="what the request gave but was changed or ignored")


class ImagesResponse(BaseModel):
    """OpenAI's images response, with klein's record of what ran."""

    created: int = Field(description="unix seconds")
    data: list[ImageData]
    klein: KleinFields


class ReferenceImage(BaseModel):
    width: int
    height: int


class ReferenceSet(BaseModel):
    id: str
    images: list[ReferenceImage] = Field(description="each image's prepared size, in order")
    bytes: int = Field(description="device bytes its encoding holds in the cache")
    cached: bool


class ErrorFields(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """OpenAI's error shape: every refusal (4xx) and failure (5xx)."""

    error: ErrorFields


def responses(model: type[BaseModel]) -> dict:
    """The documented answers of a route that answers `model`, or klein's JSON error."""
    error = {"model": ErrorBody}
    return {200: {"model": model}, 400: error, 413: error, 422: error, 429: error, 503: error}


def with_limits(openapi: dict, max_steps: int, max_images: int) -> dict:
    """`openapi` with this server's limits where the request type's declarations are wider (in the
    bounds and in the words: "1 to 1000" steps is "1 to 50" under --max-steps 50)."""
    limits = {"num_inference_steps": max_steps, "n": max_images}
    for properties in _properties(openapi):
        for name, most in limits.items():
            if name not in properties:
                continue
            field = properties[name]
            for each in [field, *field.get("anyOf", ())]:
                if each.get("type") == "integer":
                    each["maximum"] = most
            if "description" in field:
                field["description"] = re.sub(r"\b1 to \d+", f"1 to {most}", field["description"])
    return openapi


KEYLESS = ("/healthz",)
"""The API routes a keyed server answers without its key (the page and the docs are no API routes)."""


def with_key(openapi: dict) -> dict:
    """`openapi` with the Bearer key every route of a keyed server needs: /docs then has an Authorize
    button, whose key "Try it out" sends."""
    schemes = openapi.setdefault("components", {}).setdefault("securitySchemes", {})
    schemes["api_key"] = {"type": "http", "scheme": "bearer", "description": "an API key of this server"}
    openapi["security"] = [{"api_key": []}]
    for path in KEYLESS:
        for operation in openapi["paths"].get(path, {}).values():
            operation["security"] = []
    return openapi


def _properties(node):
    """Every "properties" mapping in a JSON schema, however deep."""
    if isinstance(node, dict):
        if isinstance(node.get("properties"), dict):
            yield node["properties"]
        for value in node.values():
            yield from _properties(value)
    elif isinstance(node, list):
        for value in node:
            yield from _properties(value)
