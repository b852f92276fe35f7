"""One model replica of `klein serve --replicas N`: a Ray Serve deployment that is a `Service`, as a single
`klein serve` has one; a set it does not hold is encoded from the front's images."""

from __future__ import annotations

import asyncio
import dataclasses

from klein.serve.errors import ApiError
from klein.serve.generation import Generation
from klein.serve.options import ServeOptions
from klein.serve.service import Service
from klein.serve.worker import Job

EVENT_POLL = 0.05  # seconds between looks at a job's progress


class Replica(Service):
    def __init__(self, loading, options: ServeOptions, memory_limit: int | None, version: str, warm=()):
        """`warm`: the shapes its worker compiles ahead (`klein.pipeline.warmup`) before its first job, as
        a single server's does: the replica answers at once, its health saying "warming" until then."""
        from klein.pipeline.loading import load

        pipe = load(loading)
        pipe.memory_limit = memory_limit
        super().__init__(pipe, options, version, warm)

    async def generate(self, work: Generation, images: tuple):
        """One generation as events: ("accepted", {}) or ("error", fields) at once, then ("running", {}),
        ("stage", stage) as each stage starts, ("step", progress) per denoising step, and ("done", body)
        or ("error", fields).
        `images`: (ObjectRef of the set's prepared images,) when the request has references."""
        if work.reference_id is not None:
            work = await self._with_references(work, images[0])
        try:
            job = await self.submit_generation(work)
        except ApiError as error:
            yield "error", error.fields()
            return
        yield "accepted", {}
        try:
            async for event in _follow(job):
                yield event
        finally:  # the front cancelled the request (its client left): drop the job if it has not started
            self.worker.abandon(job)

    async def _with_references(self, work: Generation, images) -> Generation:
        """The work with its set by id where this replica still holds it, else with its images."""
        if self.sets.describe(work.reference_id, work.owner) is not None:
            return work
        return dataclasses.replace(work, images=tuple(await images), reference_id=None)

    async def references(self, images: tuple, owner: str | None = None) -> dict:
        """POST /v1/references on the replica that will serve the set: encoded now, as `klein serve`
        does, so that the first edit finds it, as `owner`'s; the reference object, or ("error", fields)."""
        try:
            job = await self.submit_references(tuple(await images[0]), owner)
            return await asyncio.wrap_future(job.future)
        except ApiError as error:
            return {"error": error.fields()}


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
    yield ("error", job.error.fields()) if job.error else ("done", job.result)
