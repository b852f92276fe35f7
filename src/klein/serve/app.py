"""The HTTP routes of `klein serve` (the contract: docs/serving.md), thin: they parse, submit a job to the
worker and await it off the event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from klein.serve import api_docs, body_cap, errors, page, schema, uploads
from klein.serve.errors import ApiError
from klein.serve.generation import Generation
from klein.serve.guard import Guard
from klein.serve.metrics import CONTENT_TYPE
from klein.serve.model_list import model_list
from klein.serve.quotas import Quotas, owner, shares
from klein.serve.service import Service
from klein.serve.streams import EventStreams
from klein.serve.viewer import viewer
from klein.serve.worker import Job

DISCONNECT_POLL = 0.25  # seconds between checks that a waiting client is still there


def create_app(service: Service) -> FastAPI:
    """The routes over one pipeline's `Service`, or N replicas' `klein.serve.replicas.front.Front`."""
    app = FastAPI(
        title="klein serve",
        version=service.version,
        description="FLUX.2 [klein] images API",
        docs_url=None,  # api_docs serves /docs without a CDN
        redoc_url=None,  # ReDoc would need one
    )
    quotas = Quotas()
    app.add_middleware(Guard, service=service, quotas=quotas)
    _errors(app)
    _routes(app, service, quotas)
    _references(app, service, quotas)
    _jobs(app, service, quotas)
    app.include_router(page.router)
    app.include_router(api_docs.router)
    build, options = app.openapi, service.options

    def openapi() -> dict:
        """`app.openapi` with the server's limits and key in the schema (built once, on first request)."""
        if app.openapi_schema is None:
            app.openapi_schema = api_docs.with_limits(build(), options.max_steps, options.max_images)
            if options.access.keys:
                api_docs.with_key(app.openapi_schema)
        return app.openapi_schema

    app.openapi = openapi
    return app


def _errors(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request, error: ApiError):
        return error.response()

    @app.exception_handler(body_cap.TooLarge)
    async def too_large(request, error: body_cap.TooLarge):
        return error.error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request, error: RequestValidationError):
        content_type = request.headers.get("content-type")
        return (schema.not_json(content_type) or schema.from_validation(error.errors())).response()

    @app.exception_handler(Exception)
    async def internal(request, error: Exception):  # a bug: uvicorn logs the traceback, the client gets JSON
        return errors.internal(error).response()

    @app.exception_handler(HTTPException)
    async def http_error(request, error: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code, "http_error")
        return ApiError(
            error.status_code, f"{request.method} {request.url.path}: {error.detail}", code
        ).response()


def _routes(app: FastAPI, service: Service, quotas: Quotas) -> None:
    options = service.options

    @app.get("/healthz")
    async def healthz():
        # 503 while compiling ahead: a load balancer or a readiness probe sends nothing yet.
        health = service.health()
        return JSONResponse(health, 503 if health["status"] == "warming" else 200)

    @app.get("/v1/config")
    async def config(request: Request):
        return service.config(viewer(request.scope))

    @app.get("/v1/loras")
    async def loras(request: Request):
        return service.loras(viewer(request.scope))

    started = int(time.time())

    @app.get("/v1/models")
    async def models():
        return model_list(service.health()["model"], started)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics(request: Request):
        return Response(service.metrics.render(viewer(request.scope)), media_type=CONTENT_TYPE)

    @app.post("/v1/images/generations", responses=api_docs.responses(api_docs.ImagesResponse))
    async def generations(body: schema.ImageBody, request: Request):
        work = _work(service, body, request)
        job = await _submitted(quotas, request, lambda: _generation(service, work))
        return await _wait(service.worker, job, request)

    @app.post(
        "/v1/images/edits",
        openapi_extra=api_docs.edits_body(),
        responses=api_docs.responses(api_docs.ImagesResponse),
    )
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

        async def submit() -> Job:
            nonlocal generation_request
            service.worker.check_room()  # before any image is decoded
            mask = None
            if form.mask is not None:
                mask = await uploads.read_mask(form.mask, options)
                generation_request = dataclasses.replace(generation_request, mask_image=mask)
            images = ()
            if body.references is None:
                repaints = generation_request.repaints
                images = tuple(await uploads.prepare(form.images, options, repaints, mask))
            return await _generation(service, _work(service, body, request, generation_request, images))

        return await _wait(service.worker, await _submitted(quotas, request, submit), request)


def _references(app: FastAPI, service: Service, quotas: Quotas) -> None:
    @app.post(
        "/v1/references",
        openapi_extra=api_docs.references_body(),
        responses=api_docs.responses(api_docs.ReferenceSet),
    )
    async def create_references(request: Request):
        """Multipart: image / image[] files, encoded once and kept in the reference cache."""
        form = await uploads.read_form(request, service.options)

        async def submit() -> Job:
            service.worker.check_room()  # before any image is decoded
            images = tuple(await uploads.prepare(form.images, service.options))
            return await service.submit_references(images, owner(request.scope))

        return await _wait(service.worker, await _submitted(quotas, request, submit), request)

    @app.get("/v1/references/{reference_id}")
    async def get_references(reference_id: str, request: Request):
        found = service.sets.describe(reference_id, owner(request.scope))
        if found is None:
            raise _unknown_reference(reference_id)
        return found

    @app.delete("/v1/references/{reference_id}")
    async def delete_references(reference_id: str, request: Request):
        if not service.sets.delete(reference_id, owner(request.scope)):
            raise _unknown_reference(reference_id)
        return {"id": reference_id, "deleted": True}


def _jobs(app: FastAPI, service: Service, quotas: Quotas) -> None:
    @app.post("/v1/jobs", status_code=202)
    async def create_job(body: schema.ImageBody, request: Request):
        work = _work(service, body, request, job=True)
        job = await _submitted(quotas, request, lambda: _generation(service, work, keep=True))
        return {"id": job.id, "status": job.status}

    @app.get("/v1/jobs/{job_id}")
    async def get_job(job_id: str, request: Request):
        return service.worker.jobs.get(job_id, owner(request.scope)).view()

    @app.delete("/v1/jobs/{job_id}")
    async def delete_job(job_id: str, request: Request):
        """Cancel a queued job, stop a running one at its next step (202: GET it until "cancelled"), or
        drop a finished one's result."""
        job = service.worker.jobs.get(job_id, owner(request.scope))
        if job.finished:
            service.worker.jobs.remove(job_id, "was deleted (DELETE /v1/jobs/ID)")
            return {"id": job_id, "status": job.status, "deleted": True}
        service.worker.cancel(job)
        if job.finished:
            return {"id": job_id, "status": job.status}
        return JSONResponse({"id": job_id, "status": "cancelling"}, 202)

    streams = EventStreams(service.options.max_event_streams, shares(service.options.access))
    service.metrics.watch_streams(lambda: streams.open)
    service.metrics.watch_keys(event_streams=lambda: dict(streams.held))

    @app.get("/v1/jobs/{job_id}/events")
    async def job_events(job_id: str, request: Request):
        """Server-sent events: queued, a stage as each stage starts (or starts compiling), one step per
        denoising step, then done, error or cancelled."""
        whose = owner(request.scope)
        job = service.worker.jobs.get(job_id, whose)
        return StreamingResponse(streams.stream(job, whose), media_type="text/event-stream")


def _work(
    service: Service, body: schema.ImageBody, request: Request, asked=None, images=(), job: bool = False
) -> Generation:
    """The generation a body asks for (`asked`: its request, if not read from it here); `job`: for POST
    /v1/jobs, whose events may carry previews."""
    asked = schema.to_request(body, service.options) if asked is None else asked
    notes = schema.ignored(body, service.health()["model"], job)
    return Generation(asked, images, body.references, notes, owner(request.scope), body.preview and job)


async def _generation(service: Service, work: Generation, keep: bool = False) -> Job:
    """`service.submit_generation` of a client's request, refused first (400) if it repaints a source
    named by a reference id (why: docs/design/serving.md, "Serving")."""
    if work.reference_id is not None and work.request.repaints:
        raise ApiError(
            400,
            "a repaint (mask or strength) takes its source as an image file, not a reference id (a set's "
            "images are centre-cropped, a source is resized): send the images as 'image' to "
            "POST /v1/images/edits",
            "invalid_value",
            "references",
        )
    return await service.submit_generation(work, keep)


async def _submitted(quotas: Quotas, request: Request, submit) -> Job:
    """The job `submit()` makes, owned by the request's API key (set before its id is answered), holding
    one of the key's job slots from before `submit` decodes anything until the job finishes."""
    release = quotas.job(request.scope.get("state", {}).get("api_key"))
    try:
        job = await submit()
    except BaseException:
        release()
        raise
    job.owner = owner(request.scope)
    job.future.add_done_callback(lambda _: release())
    return job


def _unknown_reference(reference_id: str) -> ApiError:
    return ApiError(
        404,
        f"unknown reference id {reference_id!r:.80}, or its encodings were evicted; upload the images again",
        "unknown_reference",
        "id",
    )


async def _wait(worker, job: Job, request: Request) -> dict:
    """The job's result (or its error raised); if the client leaves first, the job is dropped if queued,
    else stopped at its next step, as a DELETEd job is (its work is nobody's now)."""
    future = asyncio.wrap_future(job.future)
    while True:
        done, _ = await asyncio.wait({future}, timeout=DISCONNECT_POLL)
        if done:
            return future.result()
        if await request.is_disconnected():
            worker.abandon(job)
            # Nobody reads the job's end now: marked as read, so asyncio does not log it as lost.
            future.add_done_callback(lambda ended: ended.cancelled() or ended.exception())
            raise errors.client_closed()
