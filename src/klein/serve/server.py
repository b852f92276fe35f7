"""Running the service under uvicorn, with the graceful stop SIGTERM and Ctrl+C ask for: queued jobs fail
(503), clients still sending a body are answered 503 and cut, the running job has --shutdown-grace seconds
to finish, and `klein serve` exits 0 (past the grace, `klein.cli.interrupts` ends it: 143, or 130)."""

from __future__ import annotations

import os
import signal
import sys
from typing import NoReturn

import PIL.Image
import uvicorn

from klein.errors import InputError
from klein.serve.app import create_app
from klein.serve.connections import Protocol
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
    pipe, options: ServeOptions, host: str, port: int, version: str, warm=(), notice: StopNotice | None = None
) -> int:
    """Serve `pipe` on host:port until SIGTERM / SIGINT, compiling the `warm` shapes
    (`klein.pipeline.warmup.Shape`) first; the exit code. `notice`: told of the worker."""
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
    stopped = False  # asked to: by SIGTERM or Ctrl+C
    try:
        server.run()
        stopped = True
    except SystemExit:
        raise InputError(f"cannot serve on {host}:{port} (is the port in use? see the log above)") from None
    finally:
        service.worker.stop()
        if not (stopped and service.warming):
            service.worker.join()  # the running job's grace: past it `klein.cli.interrupts` ends the process
    if service.warming or pipe.warm_buckets.pending:
        _leave_compiling()
    return 0


def _leave_compiling() -> NoReturn:
    """Exit 0 now, with a thread still inside XLA's compiler: compiling ahead (no job runs, so nothing is
    waited for) or compiling behind the requests (every job has finished; the program is nobody's, and a
    compilation cannot be stopped, nor waited for within the grace: on a CPU it may take minutes).

    Not by returning: the interpreter's exit then ends that thread as it comes back from C++ (a daemon
    thread that asks for the GIL during finalisation is ended by `pthread_exit`, whose unwinding XLA's
    frames do not let through: "terminate called ... FATAL: exception not rethrown", SIGABRT) or tears
    down what it still uses (SIGSEGV). The server has stopped and every client has its answer; what is
    skipped is the interpreter's clean-up, with nothing left to clean: the output is flushed first. The
    program cut short is compiled again when a request first needs it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
