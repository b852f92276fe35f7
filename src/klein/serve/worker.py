"""One worker thread owns the device (the pipeline is used from it only): jobs wait on a bounded queue and
run one at a time. See docs/design/serving.md, "Serving"."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Hashable
from typing import Any

from klein.errors import CheckpointError, InputError
from klein.serve import errors
from klein.serve.jobs import JobTable

log = logging.getLogger("klein.serve")


@dataclasses.dataclass
class Job:
    work: Callable[[Job], dict] | None
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    status: str = "queued"
    progress: dict | None = None
    result: dict | None = None
    error: errors.ApiError | None = None
    events: list[tuple[str, dict]] = dataclasses.field(default_factory=list)
    """(event, data) in order; appended by the worker, read by event streams."""
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    """The result dict, or the `ApiError`."""
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    batch_key: Hashable | None = None
    """Jobs with equal keys may run as one batch; None: always alone."""
    images: int = 1
    spec: Any = None
    """What the job does (a `Generation`), for `run_batch`."""
    stopping: errors.ApiError | None = None
    """Set to stop the job at its next step (cancelled)."""
    deadline: float | None = None
    """`time.monotonic()` past which the running job stops (`--job-timeout`), from when it started."""
    on_finish: Callable[[Job], None] | None = None
    on_step: Callable[[], None] | None = None
    """Called after each denoising step the job runs (the worker counts them)."""
    owner: str | None = None
    """The label of the API key that made it (None without keys): only that key finds it by id."""

    def step(self, event) -> None:
        """The pipeline's progress callback (`klein.pipeline.stage_events.StageEvent`): "stage" and "step"
        events; raises when the job must stop, as a stage starts or a step ends, never from inside a
        compilation (jax's listener calls it)."""
        if event.finished:
            return
        if self.stopping is not None and not event.compiling:
            raise self.stopping
        # The deadline is not kept in `stopping`: run alone after its batch failed, a job has a new one.
        if self.deadline is not None and time.monotonic() > self.deadline and not event.compiling:
            raise errors.ApiError(
                504,
                "the job ran past the server's --job-timeout and was stopped; ask for fewer steps or "
                "smaller images, or raise --job-timeout",
                "job_timeout",
            )
        if event.is_step:
            self.progress = {"step": event.done, "steps": event.total}
            self.events.append(("step", dict(self.progress)))
            if self.on_step is not None:
                self.on_step()
        else:
            stage = {"stage": event.stage, "label": event.label, "compiling": event.compiling}
            self.events.append(("stage", stage))

    @property
    def finished(self) -> bool:
        return self.status in ("done", "error", "cancelled")

    def finish(self, result: dict | None = None, error: errors.ApiError | None = None) -> None:
        """Done with `result`, or failed with `error`, once (a cancelled job's late result is not its end);
        the inputs are dropped: a finished job holds its result only."""
        if self.finished:
            return
        self.result, self.error = result, error
        self.work = self.spec = None
        self.status = "done" if not error else "cancelled" if error.code == CANCELLED else "error"
        self.events.append((self.status, error.body()["error"]) if error else ("done", result))
        if self.on_finish is not None:
            self.on_finish(self)
        if error:
            self.future.set_exception(error)
        else:
            self.future.set_result(result)

    def view(self) -> dict:
        error = self.error.body()["error"] if self.error else None
        return {
            "id": self.id,
            "status": self.status,
            "progress": self.progress,
            "result": self.result,
            "error": error,
        }


CANCELLED = "cancelled"
OUTCOMES = {CANCELLED: CANCELLED, "job_timeout": "job_timeout", "client_closed": "dropped"}
"""The klein_jobs_total status of a job ended by each error code (any other: "error")."""


def cancelled(job_id: str) -> errors.ApiError:
    return errors.ApiError(409, f"job {job_id} was cancelled (DELETE /v1/jobs/{job_id})", CANCELLED)


class Stopped(Exception):
    """Every job of a batch had to stop (`together`): the batch ends."""


def together(steps: list[Callable]) -> Callable:
    """One progress for jobs that run as one batch, from their step functions (`Worker.batch_steps`): a
    job's step that raises (the job cancelled, its client gone, its time up) leaves it out from then on,
    and the batch stops (`Stopped`) only when all of them have, so that its other jobs run on unaffected."""
    live = list(steps)

    def progress(event) -> None:
        for step in list(live):
            try:
                step(event)
            except errors.ApiError:
                live.remove(step)
        if not live:
            raise Stopped

    return progress


class Worker:
    def __init__(
        self,
        max_queue: int,
        metrics,
        jobs: JobTable,
        max_batch=1,
        run_batch=None,
        job_timeout: float | None = None,
        first: Callable[[], None] | None = None,
    ):
        self.max_queue, self.metrics = max_queue, metrics
        self.max_batch, self.run_batch = max_batch, run_batch
        """`run_batch(jobs)` -> one result per job, for jobs of equal `batch_key`."""
        self.accepting = True
        self.jobs = jobs
        """The jobs submitted with `keep`, for GET /v1/jobs/{id}."""
        self.job_timeout = job_timeout
        self._queue: collections.deque[Job] = collections.deque()
        self._wake = threading.Condition()
        self._seconds_per_job = 1.0  # a running mean, for Retry-After
        self._first = first
        self._running: list[Job] = []
        """The last job or batch taken off the queue."""
        self._thread = threading.Thread(target=self._loop, name="klein-worker", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> bool:
        """Whether a job runs now, not yet finished (its client may already have its answer as the thread
        ends it): what a stop waits for (`klein.serve.server.StopNotice`)."""
        return any(not job.finished for job in self._running)

    def submit(
        self,
        work: Callable[[Job], dict],
        batch_key: Hashable | None = None,
        images: int = 1,
        spec=None,
        keep: bool = False,
        owner: str | None = None,
    ) -> Job:
        """Queue `work` of `owner`'s (an API key's label); with `keep`, the job stays findable in `jobs`
        after it finishes."""
        job = Job(work, batch_key=batch_key, images=images, spec=spec, owner=owner)
        job.on_step = self.metrics.count_step
        with self._wake:
            if not self.accepting:
                raise errors.ApiError(
                    503, "the server is shutting down; retry on another replica", "shutting_down"
                )
            self.check_room()
            job.events.append(("queued", {"position": len(self._queue)}))
            self._queue.append(job)
            if keep:
                self.jobs.add(job)
            self._wake.notify()
        return job

    def check_room(self) -> None:
        """A 429 with Retry-After when the queue is full (asked before a route decodes uploaded images)."""
        if len(self._queue) >= self.max_queue:
            seconds = max(1, round(self._seconds_per_job * (len(self._queue) + 1)))
            message = f"the queue is full ({self.max_queue} requests waiting); retry in about {seconds} s"
            raise errors.retry(429, message, "queue_full", seconds)

    def abandon(self, job: Job) -> None:
        """Its client went away: drop `job` if it has not started, else stop it at its next step."""
        self._stop(job, errors.client_closed())

    def cancel(self, job: Job) -> None:
        """Drop `job` if queued, or have it stop at its next step if running (DELETE /v1/jobs/{id})."""
        self._stop(job, cancelled(job.id))

    def _stop(self, job: Job, error: errors.ApiError) -> None:
        """End `job` with `error`: at once if queued, else at its next step (`Job.step` raises it)."""
        with self._wake:
            if job.finished or job.stopping is not None:
                return
            job.stopping = error
            if job in self._queue:
                self._queue.remove(job)
                self._failed(job, error)

    def stop(self) -> None:
        """Accept nothing more and fail the queued jobs; the running one finishes, then the thread ends."""
        with self._wake:
            self.accepting = False
            while self._queue:
                job = self._queue.popleft()
                self.metrics.count_job("shutdown")
                job.finish(error=errors.ApiError(503, "the server is shutting down", "shutting_down"))
            self._wake.notify()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _loop(self) -> None:
        if self._first is not None:
            try:
                self._first()
            except Exception:  # serving uncompiled beats not serving
                log.exception("compiling ahead failed; requests compile as they come")
        while True:
            with self._wake:
                while not self._queue and self.accepting:
                    self._wake.wait()
                if not self._queue:
                    return
                job = self._queue.popleft()
                batch = [job, *self._companions(job)]
                for each in batch:
                    each.status = "running"
                self._running = batch
            if len(batch) == 1:
                self._run(job)
            else:
                self._run_batch(batch)

    def _companions(self, first: Job) -> list[Job]:
        """Queued jobs that may run in one batch with `first` (taken off the queue)."""
        if first.batch_key is None or self.max_batch == 1:
            return []
        taken, images = [], first.images
        for job in list(self._queue):
            if job.batch_key == first.batch_key and images + job.images <= self.max_batch:
                self._queue.remove(job)
                taken.append(job)
                images += job.images
        return taken

    def _start_clock(self, job: Job) -> None:
        """The job's time limit runs from now: as it starts, and again alone after its batch failed."""
        if self.job_timeout is not None:
            job.deadline = time.monotonic() + self.job_timeout

    def batch_steps(self, jobs: list[Job]) -> list[Callable]:
        """The step functions of jobs that run as one batch (for `together`): a job that must stop is
        failed at once, its client answered, while the batch runs on for the others."""

        def step(job: Job, event) -> None:
            try:
                job.step(event)
            except errors.ApiError as error:
                self._failed(job, error)
                raise

        return [functools.partial(step, job) for job in jobs]

    def _run_batch(self, jobs: list[Job]) -> None:
        started = time.perf_counter()
        for job in jobs:
            self._start_clock(job)
        try:
            results = self.run_batch(jobs)
        except Exception:  # e.g. the batch cannot fit where each job alone can: run them one by one
            left = [job for job in jobs if not job.finished]
            if left:
                log.info("a batch of %d jobs failed as a whole; running %d one by one", len(jobs), len(left))
            for job in left:
                self._run(job)
            return
        self.metrics.count_batch(len(jobs))
        for job, result in zip(jobs, results, strict=True):
            self.metrics.observe("queue_wait", started - job.submitted)
            if not job.finished:  # a job stopped in the batch has had its answer
                self.metrics.count_job("done", job.owner)
                job.finish(result=result)

    def _run(self, job: Job) -> None:
        started = time.perf_counter()
        self.metrics.observe("queue_wait", started - job.submitted)
        self._start_clock(job)
        try:
            if job.stopping is not None:  # cancelled while its batch ran
                raise job.stopping
            result = job.work(job)
        except errors.ApiError as error:
            self._failed(job, error)
        except InputError as error:
            self._failed(job, errors.from_input_error(error))
        except CheckpointError as error:  # the server's own weights, read as a request first needed them
            log.error("job %s: %s", job.id, error)
            self._failed(job, errors.weights_refused())
        except Exception as error:  # a bug: log it, answer 500, keep serving
            log.exception("job %s failed", job.id)
            self._failed(job, errors.internal(error))
        else:
            self.metrics.count_job("done", job.owner)
            job.finish(result=result)
        elapsed = time.perf_counter() - started
        self._seconds_per_job = 0.8 * self._seconds_per_job + 0.2 * elapsed

    def _failed(self, job: Job, error: errors.ApiError) -> None:
        if not job.finished:
            self.metrics.count_job(OUTCOMES.get(error.code, "error"), job.owner)
            job.finish(error=error)
