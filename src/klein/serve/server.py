"""Running the service under uvicorn, with the graceful stop SIGTERM asks for: queued jobs fail (503),
the running one finishes, and `klein serve` exits 0."""

from __future__ import annotations

import os
import signal
import sys

import PIL.Image
import uvicorn

from klein.errors import InputError
from klein.serve.app import create_app
from klein.serve.options import ServeOptions
from klein.serve.service import Service


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, service: Service):
        super().__init__(config)
        self.service = service

    def handle_exit(self, sig, frame) -> None:
        self.service.worker.stop()
        super().handle_exit(sig, frame)


def serve(pipe, options: ServeOptions, host: str, port: int, version: str, warm=()) -> int:
    """Serve `pipe` on host:port until SIGTERM / SIGINT, compiling the `warm` shapes
    (`klein.pipeline.warmup.Shape`) first; the exit code."""
    # PIL's own guard as a second line behind the header check in klein.images.read_image.
    PIL.Image.MAX_IMAGE_PIXELS = options.max_pixels
    service = Service(pipe, options, version, warm)
    config = uvicorn.Config(
        create_app(service),
        host=host,
        port=port,
        lifespan="off",
        # asyncio's loop leaves Python's signal wake-up pipe alone (uvloop takes it while it runs), so that
        # `klein.cli.interrupts` sees a Ctrl+C that uvicorn handles too, and stops at once past its grace.
        loop="asyncio",
        log_level="info",
        # Past this many connections uvicorn answers 503 at once, rather than taking sockets and memory
        # without bound; idle keep-alive connections are closed after the timeout.
        limit_concurrency=options.limit_concurrency,
        timeout_keep_alive=options.keep_alive_timeout,
    )
    server = _Server(config, service)
    # uvicorn raises a caught SIGTERM again once it has shut down; by then the stop was graceful, so the
    # handler it restores is this one, which lets `klein serve` exit 0 instead of dying by the signal.
    signal.signal(signal.SIGTERM, lambda sig, frame: None)
    stopped = False  # asked to: by SIGTERM or Ctrl+C
    try:
        server.run()
        stopped = True
    except SystemExit:
        raise InputError(f"cannot serve on {host}:{port} (is the port in use? see the log above)") from None
    finally:
        service.worker.stop()
        if stopped and service.warming:
            # Compiling ahead runs no one's job: nothing to wait for. Stopped at once, a clean stop; not by
            # returning, since the interpreter's exit under a compile in flight aborts in XLA's threads.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        service.worker.join()
    return 0
