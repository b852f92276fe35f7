"""The connection layer under `klein serve`'s routes: uvicorn's h11 protocol with the limits it lacks, so that
no client can lock the others out by holding sockets. uvicorn starts no timer until a request arrives and
counts idle sockets against its connection limit; here a connection must send its headers within
--header-timeout, a request body must keep to --min-body-rate, and connections that have shown no API key
are capped apart (--max-unauthenticated): a new one closes the oldest idle of them rather than being
refused. Shutting down, a connection still sending its body is answered 503 and closed at once."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
from collections.abc import Callable

import h11
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from klein.errors import counted
from klein.serve.errors import ApiError
from klein.serve.options import ServeOptions, show_size

RATE_WINDOW = 5.0
"""Seconds over which a request body's rate is measured against --min-body-rate."""
LINGER = 2.0
"""Seconds a client answered before its body was read may go on sending (discarded) while it reads the
answer; then its connection is closed."""
TICK = 0.5
"""Seconds between the checks of every connection's clocks."""


@dataclasses.dataclass(frozen=True)
class Rules:
    """What each connection is held to; `trusted(authorization)`: whether a request's Authorization header
    lifts its connection out of the unauthenticated ones (any request does on a server without keys)."""

    header_timeout: float
    min_body_rate: int
    max_connections: int
    max_unauthenticated: int
    trusted: Callable[[str], bool]

    @classmethod
    def of(cls, options: ServeOptions) -> Rules:
        access = options.access
        trusted = (lambda header: access.match(header) is not None) if access.keys else (lambda header: True)
        return cls(
            options.header_timeout,
            options.min_body_rate,
            options.limit_concurrency,
            options.max_unauthenticated,
            trusted,
        )


class Connections:
    """The open connections of one server, oldest first, and the tick that holds them to their `rules`."""

    def __init__(self, rules: Rules):
        self.rules = rules
        self.open: dict[Protocol, None] = {}
        self._tick: asyncio.TimerHandle | None = None

    def opened(self, connection: Protocol) -> bool:
        """Count a new connection, closing the oldest idle unauthenticated ones it puts over a limit; False
        when none can make room (it is then refused)."""
        self.open[connection] = None
        if self._tick is None:
            self._tick = connection.loop.call_later(TICK, self._check, connection.loop)
        while self._over():
            victim = next((c for c in self.open if c is not connection and c.evictable()), None)
            if victim is None:
                self.closed(connection)
                return False
            victim.close()
        return True

    def closed(self, connection: Protocol) -> None:
        self.open.pop(connection, None)

    def _over(self) -> bool:
        unauthenticated = sum(not c.trusted for c in self.open)
        return len(self.open) > self.rules.max_connections or unauthenticated > self.rules.max_unauthenticated

    def _check(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        for connection in list(self.open):
            connection.check(now)
        self._tick = loop.call_later(TICK, self._check, loop) if self.open else None


class Protocol(H11Protocol):
    """uvicorn's h11 protocol held to `connections.rules`; `factory` makes it as uvicorn's `http` class."""

    def __init__(self, *args, connections: Connections, **kwargs):
        super().__init__(*args, **kwargs)
        self.pool, self.rules = connections, connections.rules
        self.trusted = False
        """Whether a request on it has shown a valid API key (or, without keys, whether it sent one)."""
        self.awaiting: float | None = None
        """Since when a request's headers are awaited (the connection opened, or the next request's first
        byte came); None while none is."""
        self.window: tuple[float, int] = (0.0, 0)
        """(when the current body-rate window started, bytes received in it)."""
        self.draining: float | None = None
        """Since when a refused body has been discarded."""
        self.answered = False
        """Whether `answer` ended it: what the client still sends is dropped."""

    @classmethod
    def factory(cls, options: ServeOptions) -> Callable[..., Protocol]:
        return functools.partial(cls, connections=Connections(Rules.of(options)))

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.awaiting = self.loop.time()
        if not self.pool.opened(self):
            self.answer(
                ApiError(
                    503,
                    f"the server holds {counted(self.rules.max_connections, 'connection')}, all busy "
                    "(--limit-concurrency); retry shortly",
                    "too_many_connections",
                    headers={"Retry-After": "1"},
                )
            )

    def connection_lost(self, exc) -> None:
        self.pool.closed(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.answered:
            return
        cycle = self.cycle
        if self.awaiting is None and self.conn.their_state is h11.IDLE:
            self.awaiting = self.loop.time()  # the next request's first byte
        started, count = self.window
        self.window = (started, count + len(data))
        super().data_received(data)
        if self.cycle is not cycle:  # its headers arrived: a request began
            self.awaiting, self.draining = None, None
            self.window = (self.loop.time(), 0)
            if not self.trusted:
                authorization = next((v for k, v in self.headers if k == b"authorization"), b"")
                self.trusted = self.rules.trusted(authorization.decode("latin-1"))

    def evictable(self) -> bool:
        """Whether closing it for a new connection loses nothing: unauthenticated, and no request under way."""
        return not self.trusted and (self.cycle is None or self.cycle.response_complete)

    def receiving(self) -> bool:
        """Whether the request under way is still sending its body, unanswered."""
        cycle = self.cycle
        unanswered = cycle is not None and not cycle.response_started and not self.answered
        return unanswered and self.conn.their_state is h11.SEND_BODY

    def check(self, now: float) -> None:
        """Close it if a clock has run out: the headers', the body rate's, or a refused body's."""
        if self.transport.is_closing():
            return
        if self.awaiting is not None and now - self.awaiting > self.rules.header_timeout:
            self.close()  # no request yet, so nothing to answer
        elif self.receiving():
            started, count = self.window
            if self.flow.read_paused:  # the app is not reading: the client is not to blame
                self.window = (now, 0)
            elif now - started >= RATE_WINDOW:
                if count < self.rules.min_body_rate * RATE_WINDOW:
                    rate = f"{show_size(round(count / (now - started)))}/s"
                    self.answer(
                        ApiError(
                            408,
                            f"the request body arrived at {rate}, under the {show_size(self.rules.min_body_rate)}"
                            "/s allowed (--min-body-rate); the connection was closed",
                            "body_too_slow",
                        )
                    )
                else:
                    self.window = (now, 0)
        elif (
            self.cycle is not None and self.cycle.response_complete and self.conn.their_state is h11.SEND_BODY
        ):
            self.draining = self.draining or now
            if now - self.draining > LINGER:
                self.close()

    def shutdown(self) -> None:
        if self.answered:
            self.transport.close()  # no need to linger: the server is going
        elif self.receiving():  # its request could only be refused: the worker takes no more
            self.answer(ApiError(503, "the server is shutting down", "shutting_down"))
        else:
            super().shutdown()

    def close(self) -> None:
        self.pool.closed(self)
        self.transport.close()

    def answer(self, error: ApiError) -> None:
        """Send `error` (unless a response has begun) and close; the app's request, if any, sees its client
        gone."""
        if self.answered or self.transport.is_closing():
            return
        body = json.dumps(error.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(name.lower().encode(), value.encode()) for name, value in error.headers.items()]
        headers.append((b"connection", b"close"))
        if self.cycle is None:  # before a request: h11 answers none, so the bytes are written as they are
            lines = [f"HTTP/1.1 {error.status} {STATUS_PHRASES[error.status].decode()}".encode()]
            lines += [name + b": " + value for name, value in headers]
            self.transport.write(b"\r\n".join(lines) + b"\r\n\r\n" + body)
        elif not self.cycle.response_started:
            response = h11.Response(
                status_code=error.status, headers=headers, reason=STATUS_PHRASES[error.status]
            )
            self.transport.write(b"".join(self.conn.send(event) for event in (response, h11.Data(data=body))))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
        if self.cycle is not None:
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        # Closed only once the client has had time to read the answer: a socket closed with its bytes unread
        # would send a reset, which can reach the client before the answer does.
        self.pool.closed(self)
        self.answered = True
        self.transport.write_eof()
        self.loop.call_later(LINGER, self.transport.close)
