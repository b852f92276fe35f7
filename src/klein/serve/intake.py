"""Admission from a request's headers, before a byte of its body is read: a request that would make a job is
refused (429 with Retry-After, while its client is still sending) when the queue is full or its API key
holds all its job slots; and every body reserves its size (its Content-Length, or its cap) from
--upload-budget-bytes, which all clients share, until its request ends."""

from __future__ import annotations

from collections.abc import Callable

from starlette.datastructures import Headers

from klein.serve import errors
from klein.serve.quotas import Quotas

JOB_ROUTES = frozenset({"/v1/images/generations", "/v1/images/edits", "/v1/references", "/v1/jobs"})
"""The routes where a POST makes a job."""
RETRY_SECONDS = 2
"""Retry-After of a body the budget has no room for: uploads under way take seconds, not minutes."""


class Intake:
    """The body budget of one server (the event loop's alone: no lock) and the checks made before it."""

    def __init__(self, service, quotas: Quotas):
        self.service, self.quotas = service, quotas
        self.budget = service.options.upload_budget_bytes
        self.held = 0
        """Bytes reserved by the bodies of the requests under way."""

    def admit(self, scope, headers: Headers, allowed: int) -> Callable[[], None]:
        """Admit a request whose body may hold `allowed` bytes (an `ApiError` if not); the function that
        gives its reservation back."""
        if scope["method"] == "POST" and scope["path"] in JOB_ROUTES:
            self.service.worker.check_room()
            self.quotas.check_job(scope.get("state", {}).get("api_key"))
        length = headers.get("content-length", "")
        size = int(length) if length.isdigit() else allowed if "transfer-encoding" in headers else 0
        if size and self.held + size > self.budget:
            raise errors.retry(
                429,
                f"the request bodies being received hold {_mib(self.held)} of the {_mib(self.budget)} "
                f"allowed at once (--upload-budget-bytes), too few for this one's {_mib(size)}; retry in "
                f"{RETRY_SECONDS} s",
                "uploads_busy",
                RETRY_SECONDS,
            )
        self.held += size
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.held -= size

        return release


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"
