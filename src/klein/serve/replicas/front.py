"""What the HTTP app serves in front of N replicas: `Service`'s methods, each a call through Serve's handle
to a `replica.Replica`; jobs live here, fed by each replica's events (docs/design/serving.md, "Replicas")."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import ray
from ray import serve
from ray.serve.exceptions import BackPressureError, ReplicaUnavailableError, RequestCancelledError

from klein.serve import errors
from klein.serve.app import create_app
from klein.serve.errors import ApiError
from klein.serve.generation import Generation
from klein.serve.metrics import Metrics
from klein.serve.options import ServeOptions
from klein.serve.quotas import shares
from klein.serve.replicas.affinity import routing_key
from klein.serve.replicas.restarts import FrontJobTable
from klein.serve.replicas.store import ReferenceStore
from klein.serve.viewer import ALL, Viewer
from klein.serve.worker import Job, cancelled

log = logging.getLogger("klein.serve")
RETRY_AFTER = 5
"""Seconds a client is asked to wait after losing a replica: Serve notices the death and routes around
it at once; the replacement takes longer (a pipeline load)."""
WARMING_POLL = 1.0
"""Seconds between the front's questions to replicas compiling ahead (`Front.follow_warming`)."""
NO_PREVIEWS = "preview is ignored behind --replicas: the front does not relay a replica's frames yet"
LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ReplicaUnavailableError)
"""A replica died, or cannot be reached, while it held the request."""
RESEND_DELAYS = (0.0, 0.5, 2.0)
"""Seconds before each new try of a call whose replica was lost before the job started. Serve's router
drops a replica once a call reports it dead, but one only unreachable (`ActorUnavailableError`) stays on
offer until the controller notices, so a second try can meet the same dead replica."""
APP, REPLICA = "klein", "Replica"


def lost() -> ApiError:
    return errors.retry(
        503,
        f"the replica serving this request stopped (Serve restarts it); retry in {RETRY_AFTER} s",
        "replica_lost",
        RETRY_AFTER,
    )


def busy() -> ApiError:
    message = f"every replica is busy and the queue is full; retry in {RETRY_AFTER} s"
    return errors.retry(429, message, "queue_full", RETRY_AFTER)


class Jobs:
    """The front's jobs, and what the app asks of a worker (`abandon`, `cancel`, `depth`)."""

    def __init__(self, options: ServeOptions, max_queue: int):
        self.jobs = FrontJobTable(options.max_result_bytes, options.result_ttl)
        self.max_queue = max_queue
        """Jobs that may wait, over every replica; more get 429 before their images are decoded."""
        self._calls: dict[str, object] = {}
        self._live: dict[str, Job] = {}

    @property
    def depth(self) -> int:
        return sum(job.status == "queued" for job in self._live.values())

    def check_room(self) -> None:
        """A 429 when as many jobs wait as Serve's queues take (Serve refuses past that too)."""
        if self.depth >= self.max_queue:
            raise busy()

    def add(self, job: Job, call, keep: bool = False) -> None:
        self._calls[job.id], self._live[job.id] = call, job
        if keep:
            self.jobs.add(job)

    def abandon(self, job: Job) -> None:
        """Cancel a job whose client went away: Serve cancels the call, the replica drops it if queued, else
        stops it at its next step."""
        call = self._calls.pop(job.id, None)
        if call is not None:
            call.cancel()

    def cancel(self, job: Job) -> None:
        """DELETE /v1/jobs/{id}: the call cancelled (the replica drops the job if queued, else stops it at
        its next step), the job cancelled here at once."""
        self.abandon(job)
        if not job.finished:
            job.finish(error=cancelled(job.id))

    def done(self, job: Job) -> None:
        self._calls.pop(job.id, None)
        self._live.pop(job.id, None)


class Front:
    def __init__(self, handle, options: ServeOptions, version: str, routing: str, about: dict):
        """`about`: a replica's `config()`, `health()` and `loras()`, and the replica count."""
        self.handle, self.options, self.version, self.routing = handle, options, version, routing
        self.metrics = Metrics()
        self.sets = ReferenceStore(options.cache_bytes, shares(options.access))
        self._config, self._health, self.replicas = about["config"], about["health"], about["replicas"]
        self._loras = about["loras"]
        self.worker = Jobs(options, options.max_queue * self.replicas)
        self.metrics.watch(lambda: self.worker.depth, {}, self.worker.jobs)
        self.metrics.watch_keys(reference_store_bytes=self.sets.held)

    def health(self) -> dict:
        return {**self._health, "replicas": self.replicas, "routing": self.routing}

    async def follow_warming(self) -> None:
        """While the replicas compile ahead, ask them again every `WARMING_POLL` s, so that /healthz and
        /v1/config say "warming" until a replica answers ready (all warm the same shapes, together)."""
        while self._health.get("status") == "warming":
            await asyncio.sleep(WARMING_POLL)
            self._health = await self.handle.health.remote()
            self._config = await self.handle.config.remote()

    def config(self, viewer: Viewer = ALL) -> dict:
        jobs_done = self.metrics.jobs_done(viewer)
        return {**self._config, "jobs_done": jobs_done, "replicas": self.replicas, "previews": False}

    def loras(self, viewer: Viewer = ALL) -> dict:
        """GET /v1/loras: every replica offers the same LoRAs (one set of flags); which sit in slots is each
        replica's, so not said here."""
        listed = [{k: v for k, v in entry.items() if k != "resident"} for entry in self._loras["data"]]
        return {**self._loras, "data": listed, "replicas": self.replicas}

    def _to(self, key: str | None, loras=()):
        """The handle for a request of reference set `key` (None: no references) naming `loras`."""
        routed = routing_key(key, loras)
        if not routed or self.routing == "load":
            return self.handle
        return self.handle.options(multiplexed_model_id=routed)

    async def submit_generation(self, work: Generation, keep: bool = False) -> Job:
        """Send a generation to a replica; its job once the replica has accepted it (what it refuses is
        raised here, as a single server refuses before queueing); with `keep`, findable by id."""
        if work.preview:  # the replica would decode frames nobody gets: none, and the result says so
            work = dataclasses.replace(work, preview=False, notes=(*work.notes, NO_PREVIEWS))
        key = self.sets.put(work.images, work.owner) if work.images else work.reference_id
        images = (self.sets.images(key, work.owner),) if key is not None else ()
        sent = dataclasses.replace(work, images=(), reference_id=key)
        loras = {use.name for uses in work.request.lora_sets for use in uses}

        def send():
            return self._to(key, loras).options(stream=True).generate.remote(sent, images)

        call, (name, data) = await _accepted(send)
        if name == "error":
            raise ApiError(**data)
        job = Job(None, spec=sent, id=self.worker.jobs.new_id())
        job.events.append(("queued", {"position": self.worker.depth}))
        self.worker.add(job, call, keep)
        asyncio.get_running_loop().create_task(self._follow(job, call, send))
        return job

    async def _follow(self, job: Job, call, send) -> None:
        """Record the job's events until its end; a job its lost replica had not started is sent again
        (`RESEND_DELAYS`: the router stops offering the dead replica), one it had started ends in 503."""
        try:
            for delay in (*RESEND_DELAYS, None):
                try:
                    await self._record(job, call)
                    break
                except LOST:
                    if job.status != "queued" or delay is None:
                        raise
                    log.warning("job %s: its replica was lost before it started; sending it again", job.id)
                    await asyncio.sleep(delay)
                    call = send()
                    self.worker.add(job, call)
        except LOST:
            log.warning("job %s: its replica was lost while running it", job.id)
        except (RequestCancelledError, asyncio.CancelledError):
            if not job.finished:  # not cancelled by DELETE /v1/jobs/{id}: its client went away
                self.metrics.count_job("dropped")
            job.finish(error=errors.client_closed())
        except BackPressureError:
            job.finish(error=busy())
        except Exception as error:  # a bug: log it, answer 500
            log.exception("job %s failed", job.id)
            job.finish(error=errors.internal(error))
        finally:
            self.worker.done(job)
            if not job.finished:
                self.metrics.count_job("lost")
                job.finish(error=lost())

    async def _record(self, job: Job, call) -> None:
        async for name, data in call:
            if name == "running":
                job.status = "running"
            elif name == "step":
                job.progress = data
                job.events.append(("step", data))
            elif name == "stage":
                job.events.append(("stage", data))
            elif name == "done":
                self.metrics.observe_timings(data)
                self.metrics.count_job("done", job.owner)
                job.finish(result=data)
            elif name == "error":
                self.metrics.count_job("error")
                job.finish(error=ApiError(**data))

    async def submit_references(self, images, owner: str | None = None) -> Job:
        """Keep the images as `owner`'s and have the replica that will serve the set encode it now."""
        key = self.sets.put(images, owner)
        job = Job(None, id=self.worker.jobs.new_id())
        call = self._to(key).references.remote((self.sets.images(key, owner),), owner)
        asyncio.get_running_loop().create_task(self._encoded(job, key, owner, call))
        return job

    async def _encoded(self, job: Job, key: str, owner: str | None, call) -> None:
        try:
            answer = await call
        except LOST:
            return job.finish(error=lost())
        except BackPressureError:
            return job.finish(error=busy())
        if "error" in answer:
            return job.finish(error=ApiError(**answer["error"]))
        self.sets.described(key, answer, owner)
        job.finish(result=answer)


async def _accepted(send) -> tuple[object, tuple[str, dict]]:
    """A call (`send()`) and its replica's first event: accepted, or its refusal; 429 when every replica and
    the router's queue are full. A replica lost before it answered is replaced (`RESEND_DELAYS`); then 503."""
    for delay in (*RESEND_DELAYS, None):
        call = send()
        try:
            return call, await call.__anext__()
        except BackPressureError:
            raise busy() from None
        except LOST:
            if delay is None:
                raise lost() from None
            await asyncio.sleep(delay)


@serve.ingress()
class FrontDeployment:
    """The ingress deployment: the HTTP app over a `Front`, built once the replicas answer."""

    async def __init__(self, replicas, options: ServeOptions, version: str, routing: str, count: int):
        about = {
            "config": await replicas.config.remote(),
            "health": await replicas.health.remote(),
            "loras": await replicas.loras.remote(),
            "replicas": count,
        }
        self.front = Front(replicas, options, version, routing, about)
        self._warming = asyncio.get_running_loop().create_task(self.front.follow_warming())

    def __serve_build_asgi_app__(self):
        return create_app(self.front)
