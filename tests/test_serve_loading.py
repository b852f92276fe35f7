"""While `klein serve` loads its model, its port listens and answers 503 "loading" (`klein.serve.
loading_reply`): a readiness probe reads `{"status": "loading"}`, an API client OpenAI's error shape with
Retry-After, a second server on the port is refused at once; the server then takes the same sockets. Over
loopback with a real client."""

import socket
import threading
import time

import httpx
import pytest

from klein.cli import main as cli
from klein.errors import InputError
from klein.serve import loading_reply
from klein.serve.loading_reply import LoadingReply
from klein.serve.server import bind


@pytest.fixture
def loading():
    sockets = bind("127.0.0.1", 0)
    port = sockets[0].getsockname()[1]
    with LoadingReply(sockets) as reply:
        yield port, reply
    for sock in sockets:
        sock.close()


def test_a_probe_and_a_client_are_told_it_loads(loading):
    port, _ = loading
    health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
    assert health.status_code == 503 and health.json() == {"status": "loading"}
    made = httpx.post(
        f"http://127.0.0.1:{port}/v1/images/generations",
        json={"prompt": "a fox", "size": "512x512"},
        timeout=5,
    )
    assert made.status_code == 503 and made.headers["retry-after"] == str(loading_reply.RETRY_SECONDS)
    error = made.json()["error"]
    assert error["code"] == "loading" and "GET /healthz answers 200" in error["message"]


def test_a_second_server_on_the_port_is_refused_at_once(loading):
    port, _ = loading
    with pytest.raises(InputError, match=f"port {port} is in use"):
        bind("127.0.0.1", port)


def test_a_silent_client_is_answered_and_others_are_not_held(loading):
    port, _ = loading
    with socket.create_connection(("127.0.0.1", port), timeout=5) as silent:
        started = time.monotonic()
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 503
        assert time.monotonic() - started < 2 * loading_reply.READ_SECONDS + 1
        answer = silent.recv(65536)
    assert answer.startswith(b"HTTP/1.1 503") and b'"code": "loading"' in answer


def test_once_loaded_the_sockets_are_the_servers():
    """After the context the thread answers nothing: a connection waits in the backlog for whoever serves."""
    sockets = bind("127.0.0.1", 0)
    port = sockets[0].getsockname()[1]
    with LoadingReply(sockets) as reply:
        pass
    assert not reply._thread.is_alive()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
        client.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        client.settimeout(0.5)
        with pytest.raises(TimeoutError):
            client.recv(1)  # queued, not answered
        served, _ = sockets[0].accept()  # the server's accept finds it
        with served:
            assert served.recv(1024).startswith(b"GET /healthz")
    for sock in sockets:
        sock.close()


def test_klein_serve_answers_loading_until_it_serves(klein_home, monkeypatch, capsys):
    """The CLI's real path: the load held until a probe has seen 503 loading, then the server serves."""
    from klein.pipeline import loading as pipeline_loading

    monkeypatch.setenv("KLEIN_HOME", str(klein_home))
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    seen, real = threading.Event(), pipeline_loading.load

    def held_load(options):
        assert seen.wait(60), "no probe saw the loading answer"
        raise InputError("stopped on purpose once loading was seen")

    monkeypatch.setattr(pipeline_loading, "load", held_load)
    codes = []
    server = threading.Thread(
        target=lambda: codes.append(cli.main(["serve", "--port", str(port), "--no-warm"]))
    )
    server.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not seen.is_set():
        try:
            reply = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
        except httpx.ConnectError:
            time.sleep(0.05)
            continue
        assert reply.status_code == 503 and reply.json() == {"status": "loading"}
        seen.set()
    server.join(60)
    assert seen.is_set() and codes == [2] and real is not held_load
    err = capsys.readouterr().err
    assert "meanwhile requests are answered 503, loading" in err and "stopped on purpose" in err
    for sock in bind("127.0.0.1", port):  # the port is free again: the failed load let it go
        sock.close()
