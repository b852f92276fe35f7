"""`klein serve` as a real process on 127.0.0.1 for the tests: started on a free port, ready once
/healthz answers, stopped with SIGTERM."""

from __future__ import annotations

import contextlib
import io
import json
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

HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))
"""One client for the tests' polling: `httpx.get` builds a client, and its TLS context (the CA bundle read),
at every call, 25 ms of CPU, so that a poll every 0.05 s kept a third of a core busy; 0.2 ms through this
one. It keeps no connection between requests (the tests count the server's connections)."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(
    klein_home, *flags: str, env: dict | None = None, warm: bool = False
) -> tuple[subprocess.Popen, str]:
    """(process, base URL) of a `klein serve` with the demo checkpoint, once it answers /healthz; `env`:
    variables to add to the environment (a KLEIN_API_KEY of the tests' own is not passed on). It does not
    compile ahead (--no-warm: tests/test_recompiles.py tests warming, in process) unless `warm`; a warming
    server is returned as soon as it says so (/healthz 503 "warming"), not while it loads (503 "loading")."""
    port = free_port()
    inherited = {name: value for name, value in os.environ.items() if name != "KLEIN_API_KEY"}
    env = dict(inherited, KLEIN_HOME=str(klein_home), JAX_PLATFORMS="cpu", **(env or {}))
    command = [sys.executable, "-m", "klein.cli.main", "serve", "--port", str(port), *flags]
    command += [] if warm else ["--no-warm"]
    # The log goes to a file: a pipe nobody reads would fill up and stall the server.
    log = tempfile.TemporaryFile("w+")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    process.log = log
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"klein serve exited with {process.returncode}:\n{log_of(process)}")
        with contextlib.suppress(httpx.HTTPError, ValueError):
            health = HTTP.get(url + "/healthz", timeout=2)
            # 503 "loading" while the model loads (the port already listens), then "warming" if it warms.
            if health.status_code == 200 or (warm and health.json().get("status") == "warming"):
                return process, url
        time.sleep(0.2)
    process.kill()
    raise RuntimeError("klein serve did not answer /healthz within 180 s")


def stop(process: subprocess.Popen) -> int:
    """SIGTERM, and the exit code (the log is printed if it is not 0)."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        code = process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        code = process.wait()
    if code != 0:
        print(log_of(process))
    return code


def log_of(process: subprocess.Popen) -> str:
    process.log.seek(0)
    return process.log.read()


@contextlib.contextmanager
def running(klein_home, *flags: str, env: dict | None = None, warm: bool = False):
    process, url = start(klein_home, *flags, env=env, warm=warm)
    try:
        yield url
    finally:
        stop(process)


def png(seed: int, width: int = 64, height: int = 64, mode: str = "RGB") -> bytes:
    """A random picture as PNG bytes."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    PIL.Image.fromarray(pixels).convert(mode).save(buffer, format="PNG")
    return buffer.getvalue()


def metrics(url: str, headers: dict | None = None) -> dict[str, float]:
    """/metrics as {sample name with labels: value}."""
    text = HTTP.get(url + "/metrics", headers=headers, timeout=10).text
    samples = (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return {name: float(value) for name, value in samples}


def wait_for(predicate, what: str, seconds: float = 120) -> None:
    """Until `predicate()` is true, failing the test after `seconds`."""
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def job_status(url: str, job: str, headers: dict | None = None) -> str:
    """A job's status, as GET /v1/jobs/{job} says it."""
    return HTTP.get(f"{url}/v1/jobs/{job}", headers=headers).json()["status"]


def job_events(
    url: str, job: str, headers: dict | None = None, timeout: float = 300
) -> list[tuple[str, dict]]:
    """A job's event stream read to its end: (event name, data) pairs."""
    events, name = [], None
    with HTTP.stream("GET", f"{url}/v1/jobs/{job}/events", headers=headers, timeout=timeout) as stream:
        for line in stream.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((name, json.loads(line.removeprefix("data: "))))
    return events
