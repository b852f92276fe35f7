"""`klein serve` started for a benchmark: a free port on 127.0.0.1, ready once /healthz answers, stopped
with SIGTERM; it does not compile ahead (--no-warm), as the serving benchmarks were measured before it could.
Shared by the serving benchmarks in this folder (run as `python benchmarks/serving/serve_load.py` and so on,
which puts this folder on the import path)."""

import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np
import PIL.Image


@contextlib.contextmanager
def klein_serve(*flags: str):
    """(process, base URL) of a `klein serve` with `flags`, for the `with` block."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "klein.cli.main", "serve", "--port", str(port), "--no-warm", *flags]
    log = tempfile.TemporaryFile("w+")  # a pipe nobody reads would fill up and stall the server
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if process.poll() is not None:
                log.seek(0)
                raise SystemExit(f"klein serve exited:\n{log.read()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/healthz").status_code == 200:
                    break
            time.sleep(0.5)
        yield process, url
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait()


def picture(seed: int, side: int) -> bytes:
    """A random side x side picture as PNG bytes (a new one per seed: a reference cache miss)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    PIL.Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()
