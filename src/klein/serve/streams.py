"""GET /v1/jobs/{id}/events as server-sent events. A stream holds a connection while its job runs, so streams
are counted (`--max-event-streams`) and a stream's slot is given back however it ends."""

from __future__ import annotations

import asyncio
import collections
import json
import math

from klein.serve.errors import retry

EVENT_POLL = 0.05  # seconds between looks at a job's events
RETRY_AFTER = 5  # seconds: streams end when their jobs do, which takes a job's time


class EventStreams:
    def __init__(self, cap: int, shares: int = 1):
        self.cap, self.share = cap, math.ceil(cap / shares)
        self.open = 0
        self.held: collections.Counter[str | None] = collections.Counter()
        """Streams open by owner (the API key's label)."""

    def stream(self, job, owner: str | None = None) -> _Stream:
        """The job's event stream, or 429 when `cap` streams are open, or `owner`'s share of them."""
        if self.open >= self.cap or self.held[owner] >= self.share:
            full = (
                f"{self.cap} event streams are open (--max-event-streams)"
                if self.open >= self.cap
                else f"this API key has {self.share} event streams open, its share of --max-event-streams"
            )
            raise retry(
                429,
                f"{full}; retry in {RETRY_AFTER} s, or poll GET /v1/jobs/ID",
                "too_many_streams",
                RETRY_AFTER,
            )
        self.open += 1
        self.held[owner] += 1
        return _Stream(self, job, owner)


class _Stream:
    """An async iterator of the job's events as SSE text, holding one of `streams`' slots until it ends."""

    def __init__(self, streams: EventStreams, job, owner):
        self._streams, self._events, self._owner, self._held = streams, _events(job), owner, True

    def __aiter__(self):
        return self

    async def __anext__(self) -> str:
        try:
            return await self._events.__anext__()
        except BaseException:  # the end (StopAsyncIteration), or the client gone (CancelledError)
            self._release()
            raise

    def _release(self) -> None:
        if self._held:
            self._held = False
            self._streams.open -= 1
            self._streams.held[self._owner] -= 1

    def __del__(self):  # a response dropped before it was read
        self._release()


async def _events(job):
    sent = 0
    while True:
        events = job.events[sent:]
        for name, data in events:
            yield f"event: {name}\ndata: {json.dumps(data)}\n\n"
        sent += len(events)
        if job.finished and sent == len(job.events):
            return
        await asyncio.sleep(EVENT_POLL)
