"""Running the service under uvicorn, with the graceful stop SIGTERM and Ctrl+C ask for: queued jobs fail
(503), clients still sending a body are answered 503 and cut, the running job has --shutdown-grace seconds
to finish, and `klein serve` exits 0 (past the grace, `klein.cli.interrupts` ends it: 143, or 130)."""

from __future__ import annotations

import errno
import os
import signal
import socket
import sys
from typing import NoReturn

import PIL.Image
import uvicorn

from klein.errors import InputError
from klein.serve.app import create_app
from klein.serve.connections import Protocol
from klein.serve.loading_reply import LoadingReply
from klein.serve.options import ServeOptions
from klein.serve.service import Service
from klein.serve.worker import Worker


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, service: Service):
        super().__init__(config)
        self.service = service

    def handle_exit(self, sig, frame) -> None:
        self.service.worker.stop()
        super().handle_exit(sig, frame)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:  # uvicorn says where it listens only of the sockets it binds itself
            for sock in sockets or ():
                host, port = sock.getsockname()[:2]
                shown = f"[{host}]" if ":" in host else host
                print(f"klein serve: listening on http://{shown}:{port}", file=sys.stderr, flush=True)


def bind(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to every address of `host` at `port`, as asyncio's server binds them (SO_REUSEADDR,
    IPv6 sockets IPv6 only), not yet listening (`klein.serve.loading_reply` makes them listen, answering 503,
    while the model loads). Refused (an `InputError`, exit 2) when one cannot be bound, the message saying
    why and what to do."""
    where = f"{host}:{port}"
    if not 0 <= port <= 65535:
        raise InputError(f"--port {port}: give a port from 1 to 65535 (0: any free one)")
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        reason = error.strerror
        raise InputError(f"cannot serve on {where}: --host {host!r} is no address here ({reason})") from None
    bound: list[socket.socket] = []
    try:
        for family, kind, protocol, _, address in dict.fromkeys(addresses):
            sock = socket.socket(family, kind, protocol)
            bound.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError as error:
        for sock in bound:
            sock.close()
        raise InputError(_refusal(where, port, error)) from None
    return bound


def while_loading(sockets: list[socket.socket]) -> LoadingReply:
    """The context in which `sockets` (from `bind`) listen while the model loads, each connection answered
    503 "loading" (`klein.serve.loading_reply`); `serve` takes them once it is left."""
    return LoadingReply(sockets)


def _refusal(where: str, port: int, error: OSError) -> str:
    if error.errno == errno.EADDRINUSE:
        other = port + 1 if port < 65535 else 8000
        return (
            f"cannot serve on {where}: port {port} is in use (another klein serve, or another program, "
            f"listens on it): stop that server, or pass --port with a free port (e.g. --port {other})"
        )
    if error.errno == errno.EACCES:
        privileged = " (a port below 1024 needs privileges): pass --port 1024 or above" if port < 1024 else ""
        return f"cannot serve on {where}: {error.strerror}{privileged or ': pass another --port'}"
    if error.errno == errno.EADDRNOTAVAIL:
        return f"cannot serve on {where}: no interface of this machine has that address: pass another --host"
    return f"cannot serve on {where}: {error.strerror or error}: pass another --host or --port"


class StopNotice:
    """The line a stop prints (`klein.cli.interrupts.stoppable` asks for it at the signal): that the running
    job has the grace to finish when one runs, else only that the server stops."""

    def __init__(self, grace: float):
        self.grace = grace
        self.worker: Worker | None = None
        """The server's, once it serves."""

    def __call__(self) -> str:
        if self.worker is not None and self.worker.running:
            return f"stopping: nothing new is accepted; the running job has {self.grace:g} s to finish"
        return "stopping"


def serve(
    pipe,
    options: ServeOptions,
    host: str,
    port: int,
    version: str,
    warm=(),
    notice: StopNotice | None = None,
    sockets: list[socket.socket] | None = None,
) -> int:
    """Serve `pipe` on host:port (on `sockets` bound there, else bound now) until SIGTERM / SIGINT, compiling
    the `warm` shapes (`klein.pipeline.warmup.Shape`) first; the exit code. `notice`: told of the worker."""
    sockets = bind(host, port) if sockets is None else sockets
    # PIL's own guard as a second line behind the header check in klein.images.read_image.
    PIL.Image.MAX_IMAGE_PIXELS = options.max_pixels
    service = Service(pipe, options, version, warm)
    if notice is not None:
        notice.worker = service.worker
    config = uvicorn.Config(
        create_app(service),
        host=host,
        port=port,
        lifespan="off",
        # asyncio's loop leaves Python's signal wake-up pipe alone (uvloop takes it while it runs), so that
        # `klein.cli.interrupts` sees a Ctrl+C that uvicorn handles too, and stops at once past its grace.
        loop="asyncio",
        log_level="info",
        # h11 (not httptools, where installed), held to the limits uvicorn lacks: klein.serve.connections
        # counts the connections (--limit-concurrency), so uvicorn's own count, idle sockets included, is off.
        http=Protocol.factory(options),
        ws="none",  # no route takes a WebSocket, and an upgraded connection would leave klein's clocks
        limit_concurrency=None,
        timeout_keep_alive=options.keep_alive_timeout,
        timeout_graceful_shutdown=options.shutdown_grace,
    )
    server = _Server(config, service)
    # uvicorn raises a caught SIGTERM again once it has shut down; by then the stop was graceful, so the
    # disposition it restores is this one, which lets `klein serve` exit 0 instead of dying by the signal.
    # Ignored rather than handled: a Python handler would wake `klein.cli.interrupts` as a second SIGTERM.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    failed = None
    try:
        server.run(sockets=sockets)
    except SystemExit:  # uvicorn could not start on the sockets bound
        failed = f"cannot serve on {host}:{port} (see the log above)"
    finally:
        service.worker.stop()
        if not service.warming:  # compiling ahead runs no one's job: nothing to wait for
            service.worker.join()  # the running job's grace: past it `klein.cli.interrupts` ends the process
    if service.warming or pipe.warm_buckets.pending:
        _leave_compiling(failed)
    if failed:
        raise InputError(failed)
    return 0


def _leave_compiling(failed: str | None) -> NoReturn:
    """Exit now (0 after a stop, 2 with the error `failed`), with a thread still inside XLA's compiler:
    compiling ahead (no job runs, so nothing is waited for) or compiling behind the requests (every job has
    finished; the program is nobody's, and a compilation cannot be stopped, nor waited for within the
    grace: on a CPU it may take minutes).

    Not by returning: the interpreter's exit then ends that thread as it comes back from C++ (a daemon
    thread that asks for the GIL during finalisation is ended by `pthread_exit`, whose unwinding XLA's
    frames do not let through: "terminate called ... FATAL: exception not rethrown", SIGABRT) or tears
    down what it still uses (SIGSEGV). The server has stopped and every client has its answer; what is
    skipped is the interpreter's clean-up, with nothing left to clean: the output is flushed first. The
    program cut short is compiled again when a request first needs it."""
    if failed:
        print(f"error: {failed}", file=sys.stderr)  # as `klein.cli.main` says an error, exit 2
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(2 if failed else 0)
