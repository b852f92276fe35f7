"""One model replica of `klein serve --replicas N`: a Ray Serve deployment holding its own `Service`
(pipeline, prompt cache, reference cache, worker thread), as a single `klein serve` holds one.

Reference affinity is Serve's model multiplexing, keyed by reference set id: the front sends each
request for a set with `multiplexed_model_id=<set id>`, and `_reference_set` is the multiplexed loader.
Serve's router sends a request to a replica that reports the id loaded; for an id no replica has, to the
replica with the fewest; when the replicas holding it are full (`max_ongoing_requests`), to another
after a short wait, which then encodes the set too. The loader itself holds nothing: the set's
encodings live in the replica's byte-bounded reference cache, and a set the cache has dropped is
encoded again from the images the front keeps (`klein.serve.replicas.store`).
"""

from __future__ import annotations

import asyncio
import dataclasses

from ray import serve

from klein.serve.errors import ApiError
from klein.serve.generation import Generation
from klein.serve.options import ServeOptions
from klein.serve.service import Service
from klein.serve.worker import Job

MAX_SETS = 64
"""Reference set ids a replica advertises to the router (least recently used beyond); what it really
keeps is its reference cache's choice (--cache-bytes)."""
EVENT_POLL = 0.05  # seconds between looks at a job's progress


class Replica:
    def __init__(self, loading, options: ServeOptions, memory_limit: int | None, version: str):
        from klein.pipeline.flux2_klein import load

        pipe = load(loading)
        pipe.memory_limit = memory_limit
        self.service = Service(pipe, options, version)

    @serve.multiplexed(max_num_models_per_replica=MAX_SETS)
    async def _reference_set(self, set_id: str) -> str:
        """Serve's loader for a multiplexed "model": here only the mark that this replica serves the set
        (the reference cache holds the encodings)."""
        return set_id

    async def _mark(self) -> None:
        """Tell the router this replica serves the request's set (none under `--routing load`)."""
        key = serve.get_multiplexed_model_id()
        if key:
            await self._reference_set(key)

    async def generate(self, work: Generation, images: tuple):
        """One generation as events: ("accepted", {}) or ("error", fields) at once, then ("running", {}),
        ("step", progress) per denoising step, and ("done", body) or ("error", fields).
        `images`: (ObjectRef of the set's prepared images,) when the request has references."""
        if work.reference_id is not None:
            await self._mark()
            work = await self._with_references(work, images[0])
        try:
            job = await self.service.submit_generation(work)
        except ApiError as error:
            yield "error", fields(error)
            return
        yield "accepted", {}
        try:
            async for event in _follow(job):
                yield event
        finally:  # the front cancelled the request (its client left): drop the job if it has not started
            self.service.worker.abandon(job)

    async def _with_references(self, work: Generation, images) -> Generation:
        """The work with its set by id where this replica still holds it, else with its images."""
        if self.service.sets.describe(work.reference_id) is not None:
            return work
        return dataclasses.replace(work, images=tuple(await images), reference_id=None)

    async def references(self, images: tuple) -> dict:
        """POST /v1/references on the replica that will serve the set: encoded now, as `klein serve`
        does, so that the first edit finds it; the reference object, or ("error", fields)."""
        await self._mark()
        try:
            job = await self.service.submit_references(tuple(await images[0]))
            return await asyncio.wrap_future(job.future)
        except ApiError as error:
            return {"error": fields(error)}

    def config(self) -> dict:
        return self.service.config()

    def health(self) -> dict:
        return self.service.health()


async def _follow(job: Job):
    """The job's progress as events, until its end (the last one: its result or its error)."""
    sent, running = 0, False
    while True:
        finished = job.finished  # read first: every event before the end is then among those below
        if not running and job.status != "queued":
            running = True
            yield "running", {}
        new = job.events[sent:]
        sent += len(new)
        for name, data in new:
            if name == "step":
                yield "step", data
        if finished:
            break
        await asyncio.sleep(EVENT_POLL)
    yield ("error", fields(job.error)) if job.error else ("done", job.result)


def fields(error: ApiError) -> dict:
    """An `ApiError` as plain data, to cross to the front."""
    return {
        "status": error.status,
        "message": error.message,
        "code": error.code,
        "param": error.param,
        "headers": error.headers,
    }
