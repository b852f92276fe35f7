"""The jobs of POST /v1/jobs, kept by bytes and age, not count; a dropped id is remembered to answer
"expired", not "unknown". The worker finishes jobs while the event loop reads the table: hence the lock."""

from __future__ import annotations

import collections
import threading
import time

from klein.serve.errors import ApiError

GONE = 4096
"""Ids of dropped jobs remembered, to say why they are gone."""
EVENT_BYTES = 256
"""Bytes counted for each event of a kept job beyond its images (a step's progress, a result's fields)."""


class JobTable:
    def __init__(self, budget: int, ttl: float, clock=time.monotonic):
        self.budget, self.ttl, self._clock = budget, ttl, clock
        self.bytes = 0
        self.expired = 0
        """Results dropped, for their age or for room."""
        self._jobs: dict[str, object] = {}
        self._done: collections.OrderedDict[str, tuple[float, int]] = collections.OrderedDict()
        """Finished jobs, oldest first: (when it finished, its bytes)."""
        self._gone: collections.OrderedDict[str, tuple[str, str | None]] = collections.OrderedDict()
        """Id -> (why it is gone, its owner)."""
        self._lock = threading.Lock()

    def __len__(self) -> int:
        self._sweep()
        return len(self._jobs)

    def add(self, job) -> None:
        """Keep `job` until it finishes, then as its result's bytes and age allow."""
        with self._lock:
            self._jobs[job.id] = job
        job.on_finish = self._finished
        if job.finished:  # it finished before it was added
            self._finished(job)

    def get(self, job_id: str, owner: str | None = None):
        """`owner`'s job, or a 404 saying whether it is unknown (or another's), expired or deleted."""
        self._sweep()
        with self._lock:
            job = self._jobs.get(job_id)
            why, whose = self._gone.get(job_id, (None, None))
        if job is not None and job.owner == owner:
            return job
        if why is not None and whose == owner:
            raise ApiError(404, f"job {job_id} {why}", "job_expired", "id")
        raise ApiError(404, f"unknown job id {job_id!r:.80}", "unknown_job", "id")

    def remove(self, job_id: str, why: str) -> None:
        with self._lock:
            self._drop(job_id, why)

    def _finished(self, job) -> None:
        data = (job.result or {}).get("data", ())
        size = sum(len(item.get("b64_json") or "") for item in data) + EVENT_BYTES * (len(job.events) + 1)
        with self._lock:
            if job.id not in self._jobs:
                return
            self._done[job.id] = (self._clock(), size)
            self.bytes += size
            while self.bytes > self.budget and self._done:
                oldest = next(iter(self._done))
                self._drop(
                    oldest,
                    "was dropped to keep finished results under --max-result-bytes; "
                    "fetch results sooner, or raise it",
                )
                self.expired += 1

    def _sweep(self) -> None:
        """Drop the results older than `ttl`."""
        now = self._clock()
        with self._lock:
            while self._done:
                oldest, (finished, _) = next(iter(self._done.items()))
                if now - finished < self.ttl:
                    return
                self._drop(oldest, f"expired: finished results are kept for --result-ttl {self.ttl:g} s")
                self.expired += 1

    def _drop(self, job_id: str, why: str) -> None:
        """Forget a job (the lock held), remembering why and whose."""
        job = self._jobs.pop(job_id, None)
        _, size = self._done.pop(job_id, (0.0, 0))
        self.bytes -= size
        self._gone[job_id] = (why, job.owner if job is not None else None)
        while len(self._gone) > GONE:
            self._gone.popitem(last=False)
