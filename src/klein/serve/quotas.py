"""Per-key limits of `klein serve`: requests a minute (a token bucket) and jobs at once (`KEY rpm=N
jobs=N`), each exceeded one a 429 with Retry-After; and the shares of what keys hold (`shares`)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

from klein.errors import counted
from klein.serve import errors
from klein.serve.errors import ApiError
from klein.serve.security import Access, ApiKey


def shares(access: Access) -> int:
    """Into how many shares the server's reference cache and event streams are cut: one for each key (one
    without keys), so that no key's uploads or streams can take what another needs."""
    return max(1, len(access.keys))


def owner(scope) -> str | None:
    """Whose a request's jobs and reference sets are: the label of its API key (`guard` leaves the key in
    the scope's state), None without keys. A label names where the key came from, never the key."""
    key = scope.get("state", {}).get("api_key")
    return key.label if key is not None else None


class Quotas:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._tokens: dict[str, tuple[float, float]] = {}
        """Key label -> (tokens left, when they were counted)."""
        self._jobs: dict[str, int] = {}
        self._lock = threading.Lock()

    def request(self, key: ApiKey) -> None:
        """Count one request of `key`; a 429 if it has none left this minute."""
        if key.rpm is None:
            return
        now, rate = self._clock(), key.rpm / 60
        with self._lock:
            tokens, then = self._tokens.get(key.label, (float(key.rpm), now))
            tokens = min(float(key.rpm), tokens + (now - then) * rate)
            if tokens < 1:
                self._tokens[key.label] = (tokens, now)
                retry = math.ceil((1 - tokens) / rate)
                raise _limited(f"{counted(key.rpm, 'request')} a minute", key, retry)
            self._tokens[key.label] = (tokens - 1, now)

    def check_job(self, key: ApiKey | None) -> None:
        """A 429 if `key` holds all its job slots, taking none (asked from a request's headers, before its
        body is read; `job` takes the slot once it is)."""
        if key is not None and key.jobs is not None:
            with self._lock:
                if self._jobs.get(key.label, 0) >= key.jobs:
                    raise _limited(f"{counted(key.jobs, 'job')} at once", key, 1)

    def job(self, key: ApiKey | None) -> Callable[[], None]:
        """Take one of `key`'s job slots (a 429 if all are taken); the function that gives it back."""
        if key is None or key.jobs is None:
            return lambda: None
        with self._lock:
            running = self._jobs.get(key.label, 0)
            if running >= key.jobs:
                raise _limited(f"{counted(key.jobs, 'job')} at once", key, 1)
            self._jobs[key.label] = running + 1
        released = threading.Event()

        def release() -> None:
            with self._lock:
                if not released.is_set():
                    released.set()
                    self._jobs[key.label] -= 1

        return release


def _limited(limit: str, key: ApiKey, retry: int) -> ApiError:
    return errors.retry(
        429, f"this API key ({key.label}) may make {limit}; retry in {retry} s", "rate_limited", retry
    )
