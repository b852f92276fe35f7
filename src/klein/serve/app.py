"""The HTTP routes of `klein serve` (the contract: docs/design.md, "Serving"); thin by design.

Handlers parse and validate, submit a job to the worker and await it without blocking the event loop;
a synchronous request whose client goes away while its job still waits drops the job. Every error is
OpenAI's JSON error shape (`klein.serve.errors`). With an API key, every route but /healthz, the web
page and the files under /static/ needs `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from klein.serve import api_docs, errors, page, schema, uploads
from klein.serve.errors import ApiError
from klein.serve.generation import Generation
from klein.serve.metrics import CONTENT_TYPE
from klein.serve.service import Service
from klein.serve.streams import EventStreams
from klein.serve.worker import Job

DISCONNECT_POLL = 0.25  # seconds between checks that a waiting client is still there
PUBLIC = ("/healthz", "/")
PUBLIC_PREFIX = "/static/"  # the web page's and the docs' files: no data, so no key needed
_MULTIPART = {"requestBody": {"content": {"multipart/form-data": {"schema": {"type": "object"}}}}}


def create_app(service: Service) -> FastAPI:
    """The routes over `service`: one pipeline's (`Service`), or N replicas' (`klein.serve.replicas.front`),
    which offer the same methods."""
    app = FastAPI(
        title="klein serve",
        version=service.version,
        description="FLUX.2 [klein] images API",
        docs_url=None,  # api_docs serves /docs without a CDN
        redoc_url=None,  # ReDoc would need one
    )
    app.state.service = service
    app.add_middleware(_Guard, service=service)
    _errors(app)
    _routes(app, service)
    _references(app, service)
    _jobs(app, service)
    # The web page: GET / and its assets under /static/.
    app.include_router(page.router)
    # The OpenAPI docs: GET /docs, and Swagger UI's files under /static/docs/.
    app.include_router(api_docs.router)
    return app


def _errors(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request, error: ApiError):
        return JSONResponse(error.body(), error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, error: RequestValidationError):
        problem = schema.from_validation(error.errors())
        return JSONResponse(problem.body(), problem.status)

    @app.exception_handler(Exception)
    async def internal(request, error: Exception):  # a bug: uvicorn logs the traceback, the client gets JSON
        problem = errors.internal(error)
        return JSONResponse(problem.body(), problem.status)

    @app.exception_handler(HTTPException)
    async def http_error(request, error: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code, "http_error")
        body = ApiError(
            error.status_code, f"{request.method} {request.url.path}: {error.detail}", code
        ).body()
        return JSONResponse(body, error.status_code)


def _routes(app: FastAPI, service: Service) -> None:
    options = service.options

    @app.get("/healthz")
    async def healthz():
        return service.health()

    @app.get("/v1/config")
    async def config():
        return service.config()

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return Response(service.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/images/generations")
    async def generations(body: schema.ImageBody, request: Request):
        notes = schema.ignored(body, service.model_name)
        work = Generation(schema.to_request(body, options), reference_id=body.references, notes=notes)
        return await _wait(service.worker, await service.submit_generation(work), request)

    @app.post("/v1/images/edits", openapi_extra=_MULTIPART)
    async def edits(request: Request):
        """Multipart: image / image[] files, an optional mask file (inpainting: its fully transparent
        pixels are repainted in the first image) and the fields of /v1/images/generations as form fields."""
        form = await uploads.read_form(request, options, mask=True)
        body = schema.from_form(form.fields)
        if body.references is not None and form.images:
            raise ApiError(
                400, "give image files or references (an id), not both", "invalid_value", "references"
            )
        generation_request = schema.to_request(body, options)
        if form.mask is not None:
            mask = await uploads.read_mask(form.mask, options)
            generation_request = dataclasses.replace(generation_request, mask_image=mask)
        images = ()
        if body.references is None:
            images = tuple(await uploads.prepare(form.images, options, generation_request.repaints))
        notes = schema.ignored(body, service.model_name)
        work = Generation(generation_request, images, body.references, notes)
        return await _wait(service.worker, await service.submit_generation(work), request)


def _references(app: FastAPI, service: Service) -> None:
    @app.post("/v1/references", openapi_extra=_MULTIPART)
    async def create_references(request: Request):
        """Multipart: image / image[] files, encoded once and kept in the reference cache."""
        form = await uploads.read_form(request, service.options)
        images = tuple(await uploads.prepare(form.images, service.options))
        return await _wait(service.worker, await service.submit_references(images), request)

    @app.get("/v1/references/{reference_id}")
    async def get_references(reference_id: str):
        found = service.sets.describe(reference_id)
        if found is None:
            raise _unknown_reference(reference_id)
        return found

    @app.delete("/v1/references/{reference_id}")
    async def delete_references(reference_id: str):
        if not service.sets.delete(reference_id):
            raise _unknown_reference(reference_id)
        return {"id": reference_id, "deleted": True}


def _jobs(app: FastAPI, service: Service) -> None:
    @app.post("/v1/jobs", status_code=202)
    async def create_job(body: schema.ImageBody):
        notes = schema.ignored(body, service.model_name)
        work = Generation(schema.to_request(body, service.options), reference_id=body.references, notes=notes)
        job = await service.submit_generation(work, keep=True)
        return {"id": job.id, "status": job.status}

    @app.get("/v1/jobs/{job_id}")
    async def get_job(job_id: str):
        return service.worker.jobs.get(job_id).view()

    @app.delete("/v1/jobs/{job_id}")
    async def delete_job(job_id: str):
        """Cancel a queued job, stop a running one at its next step (202: GET it until "cancelled"), or
        drop a finished one's result."""
        job = service.worker.jobs.get(job_id)
        if job.finished:
            service.worker.jobs.remove(job_id, "was deleted (DELETE /v1/jobs/ID)")
            return {"id": job_id, "status": job.status, "deleted": True}
        service.worker.cancel(job)
        if job.finished:
            return {"id": job_id, "status": job.status}
        return JSONResponse({"id": job_id, "status": "cancelling"}, 202)

    streams = EventStreams(service.options.max_event_streams)
    service.metrics.watch_streams(lambda: streams.open)

    @app.get("/v1/jobs/{job_id}/events")
    async def job_events(job_id: str):
        """Server-sent events: queued, one step per denoising step, then done, error or cancelled."""
        job = service.worker.jobs.get(job_id)
        return StreamingResponse(streams.stream(job), media_type="text/event-stream")


def _unknown_reference(reference_id: str) -> ApiError:
    return ApiError(
        404,
        f"unknown reference id {reference_id!r:.80}, or its encodings were evicted; upload the images again",
        "unknown_reference",
        "id",
    )


async def _wait(worker, job: Job, request: Request) -> dict:
    """The job's result (or its error raised); drops the job if the client leaves before it starts."""
    future = asyncio.wrap_future(job.future)
    while True:
        done, _ = await asyncio.wait({future}, timeout=DISCONNECT_POLL)
        if done:
            return future.result()
        if job.status == "queued" and await request.is_disconnected():
            worker.abandon(job)


class _Guard:
    """Pure ASGI middleware: the API key check, and HTTP responses counted and timed by status for
    /metrics (the time until the response's last byte: a job's event stream counts as long as it runs)."""

    def __init__(self, app, service: Service):
        self.app, self.service = app, service

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        metrics, started, status = self.service.metrics, time.perf_counter(), []

        async def counted(message):
            if message["type"] == "http.response.start":
                status.append(str(message["status"]))
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                metrics.count_request(status[0], time.perf_counter() - started)

        if not self._allowed(scope):
            error = ApiError(
                401, "missing or wrong API key: send 'Authorization: Bearer KEY'", "unauthorized"
            )
            response = JSONResponse(error.body(), 401, headers={"WWW-Authenticate": "Bearer"})
            return await response(scope, receive, counted)
        return await self.app(scope, receive, counted)

    def _allowed(self, scope) -> bool:
        key = self.service.options.api_key
        path = scope["path"]
        if key is None or path in PUBLIC or path.startswith(PUBLIC_PREFIX):
            return True
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"").decode("latin-1")
        return hmac.compare_digest(given.encode(), f"Bearer {key}".encode())
