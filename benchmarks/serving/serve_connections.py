"""What klein's connection layer (`klein.serve.connections`) costs: requests a second over loopback to a
small JSON route, served by uvicorn's own h11 protocol (and httptools, where installed) and by klein's (the same
h11 with its timers, caps and counts), one client at a time, each request on a new connection and all on one kept-alive connection; then
klein's again with --idle sockets open that never send a byte. The route is a plain ASGI one, so that the
figures are the protocol's and the loop's, not the model's.

    python benchmarks/serving/serve_connections.py --requests 500 --idle 256
"""

import argparse
import importlib.util
import socket
import statistics
import threading
import time

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from klein.serve.connections import Protocol
from klein.serve.options import ServeOptions

BODY = b'{"status":"ok"}'


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": BODY})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serving(http) -> tuple[uvicorn.Server, str]:
    port = free_port()
    config = uvicorn.Config(app, port=port, http=http, lifespan="off", log_level="warning", loop="asyncio")
    server = uvicorn.Server(config)
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    return server, f"http://127.0.0.1:{port}"


REQUEST = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def answer(sock: socket.socket) -> None:
    """Read one response (a raw socket: the client's own cost stays small beside the server's)."""
    received = b""
    while not received.endswith(BODY):
        chunk = sock.recv(4096)
        if not chunk:
            raise RuntimeError(f"the server closed the connection: {received!r}")
        received += chunk
    assert received.startswith(b"HTTP/1.1 200"), received


def rate(url: str, requests: int, fresh: bool) -> tuple[float, float]:
    """(requests a second, median ms) of `requests` sequential GETs."""
    times, kept = [], socket.create_connection(address(url))
    for _ in range(requests):
        started = time.perf_counter()
        if fresh:
            with socket.create_connection(address(url)) as sock:
                sock.sendall(REQUEST)
                answer(sock)
        else:
            kept.sendall(REQUEST)
            answer(kept)
        times.append(time.perf_counter() - started)
    kept.close()
    return requests / sum(times), statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--idle", type=int, default=256)
    args = parser.parse_args()
    print("| protocol | connections | requests/s | median ms |\n|---|---|---|---|")
    protocols = [("uvicorn h11", H11Protocol), ("klein", Protocol.factory(ServeOptions()))]
    if importlib.util.find_spec("httptools"):  # what uvicorn's "auto" takes where it is installed
        protocols.insert(0, ("uvicorn httptools", "httptools"))
    for name, http in protocols:
        server, url = serving(http)
        rate(url, 20, False)  # warm-up
        for fresh in (True, False):
            per_second, median = rate(url, args.requests, fresh)
            kind = "new each request" if fresh else "one kept alive"
            print(f"| {name} | {kind} | {per_second:,.0f} | {median:.2f} |")
        if name == "klein":
            idle = [socket.create_connection(address(url)) for _ in range(args.idle)]
            per_second, median = rate(url, args.requests, True)
            print(
                f"| {name}, {args.idle} idle sockets open | new each request | {per_second:,.0f} | {median:.2f} |"
            )
            for sock in idle:
                sock.close()
        server.should_exit = True


if __name__ == "__main__":
    main()
