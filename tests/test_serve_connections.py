"""`klein serve` against clients that hold its sockets, over loopback with raw sockets: idle connections
that never send a byte (they lock no keyed client out, and are closed), a body trickled in (cut), uploads
refused from their headers before their body is sent (the body budget, the key's jobs, a full queue), and
SIGTERM with a client still sending (the server exits). One server for the file; the SIGTERM test ends it, last."""

import selectors
import signal
import socket
import subprocess
import time

import httpx
import pytest

from tests.support.serve_process import job_status, log_of, start, stop, wait_for

KEY = "connections-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMITED = "limited-key"  # jobs=1
IDLE = 256  # --limit-concurrency's default: every connection uvicorn would serve
UPLOAD = 48 * 2**20  # four 2048^2 PNGs of noise
# Running (compiling, then stepping) for well over the moments a test needs the queue full.
LONG = {"prompt": "a long job", "size": "512x512", "num_inference_steps": 50, "seed": 1}
SHORT = {"prompt": "a short job", "size": "64x64", "num_inference_steps": 1, "seed": 2}


@pytest.fixture(scope="module")
def server(klein_home):
    env = {"KLEIN_API_KEY": f"{LIMITED} jobs=1"}
    flags = ("--api-key", KEY, "--max-queue", "2", "--header-timeout", "2")  # 2: the idle test's wait
    process, url = start(klein_home, *flags, env=env)
    yield process, url
    stop(process)


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def upload_head(length: int, key: str = KEY) -> bytes:
    """The headers of a multipart edit of `length` bytes, with `key`."""
    return (
        f"POST /v1/images/edits HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: multipart/form-data; boundary=b\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def file_part(size: int) -> bytes:
    """The start of an image file's part, `size` bytes of it: a body's first bytes, well formed."""
    head = b'--b\r\nContent-Disposition: form-data; name="image"; filename="a.png"\r\n\r\n'
    return head + b"\0" * size


def answered(sock: socket.socket, seconds: float) -> bytes:
    """The response the server sent within `seconds`, whole (b"" if it closed, or sent nothing)."""
    sock.settimeout(seconds)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
            head, _, body = received.partition(b"\r\n\r\n")
            length = [line for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")]
            if length and len(body) >= int(length[0].split(b":")[1]):
                break
    except (TimeoutError, ConnectionError):
        pass
    return received


def closed_by_server(sockets: list[socket.socket], seconds: float) -> int:
    """How many of `sockets` the server closes within `seconds` (each read to its end)."""
    selector, count, deadline = selectors.DefaultSelector(), 0, time.monotonic() + seconds
    for sock in sockets:
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
    while count < len(sockets) and (left := deadline - time.monotonic()) > 0:
        for key, _ in selector.select(left):
            try:
                data = key.fileobj.recv(4096)
            except ConnectionError:
                data = b""
            if not data:
                selector.unregister(key.fileobj)
                count += 1
    selector.close()
    return count


def test_idle_unauthenticated_sockets_lock_no_keyed_client_out_and_are_closed(server):
    _, url = server
    idle = [connect(url) for _ in range(IDLE)]  # never a byte
    try:
        # Accepted after all of them (the listen queue is in order): served, not 503.
        config = httpx.get(url + "/v1/config", headers=AUTH, timeout=10)
        assert config.status_code == 200, config.text
        assert httpx.get(url + "/healthz", timeout=10).status_code == 200
        # Past --header-timeout (2 s) each is closed, if a newer one has not closed it already.
        assert closed_by_server(idle, 30) == IDLE
    finally:
        for sock in idle:
            sock.close()


def test_a_body_trickled_in_is_cut(server):
    _, url = server
    with connect(url) as sock:
        sock.sendall(upload_head(2**20) + file_part(0))
        received, deadline = b"", time.monotonic() + 30
        while not received and time.monotonic() < deadline:
            try:
                sock.sendall(b"x")  # 2 bytes a second, far under --min-body-rate
            except ConnectionError:
                pass
            received = answered(sock, 0.5)
        assert received.startswith(b"HTTP/1.1 408"), received
        assert b"body_too_slow" in received and b"--min-body-rate" in received


def test_an_upload_past_the_body_budget_is_refused_from_its_headers(server):
    _, url = server
    holding = [connect(url) for _ in range(10)]  # 10 x 50 MiB announced: 500 of the 512 MiB
    try:
        for sock in holding:
            sock.sendall(upload_head(50 * 2**20))
        httpx.get(url + "/healthz")  # after the 10 were admitted (one event loop, in order)
        with connect(url) as sock:
            sock.sendall(upload_head(UPLOAD) + file_part(2**16))
            refused = answered(sock, 10)
        assert refused.startswith(b"HTTP/1.1 429") and b"uploads_busy" in refused, refused
        assert b"retry-after: 2" in refused.lower()
    finally:
        for sock in holding:
            sock.close()


def refused_upload(url: str, key: str) -> bytes:
    """The answer to a 48 MiB upload with `key`, of which 64 KiB is sent before it is read."""
    with connect(url) as sock:
        sock.sendall(upload_head(UPLOAD, key) + file_part(2**16))
        return answered(sock, 10)


def test_an_upload_past_its_key_s_jobs_or_to_a_full_queue_is_refused_before_its_body_is_sent(server):
    _, url = server
    running = httpx.post(url + "/v1/jobs", json=LONG, headers=AUTH).json()["id"]
    wait_for(lambda: job_status(url, running, AUTH) == "running", "the long job to start")
    jobs = [httpx.post(url + "/v1/jobs", json=SHORT, headers={"Authorization": f"Bearer {LIMITED}"})]
    try:
        assert jobs[0].status_code == 202  # queued: the limited key's one job
        over = refused_upload(url, LIMITED)
        assert over.startswith(b"HTTP/1.1 429") and b"rate_limited" in over and b"1 job at once" in over, over
        jobs.append(httpx.post(url + "/v1/jobs", json=SHORT, headers=AUTH))
        assert jobs[1].status_code == 202  # --max-queue 2: full
        full = refused_upload(url, KEY)
        assert full.startswith(b"HTTP/1.1 429"), full
        assert b"queue_full" in full and b"retry-after:" in full.lower()
    finally:
        for job in [*(job.json().get("id") for job in jobs), running]:
            if job is not None:
                httpx.delete(f"{url}/v1/jobs/{job}", headers=AUTH)
        wait_for(
            lambda: job_status(url, running, AUTH) == "cancelled", "the long job to stop"
        )  # the worker is free


def test_sigterm_stops_the_server_while_a_client_trickles_its_body(server):
    process, url = server
    code = None
    with connect(url) as sock:
        sock.sendall(upload_head(2**20) + file_part(0))
        assert answered(sock, 0.5) == b""  # taken in: the server waits for the rest
        process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 40
        refused = answered(sock, 2)  # cut at once: its request could only be refused
        while code is None and time.monotonic() < deadline:
            try:
                sock.sendall(b"x")  # a byte every 2 s
            except ConnectionError:
                pass
            try:
                code = process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
    if code is None:
        process.kill()
    assert code == 0, log_of(process)
    assert refused.startswith(b"HTTP/1.1 503") and b"shutting_down" in refused, refused
