"""What klein's connection layer (`klein.serve.connections`) costs: requests a second over loopback to a
small JSON route, served by uvicorn's own h11 protocol and by klein's (the same h11 with its timers, caps and
counts), one client at a time, each request on a new connection and all on one kept-alive connection; then
klein's again with --idle sockets open that never send a byte. The route is a plain ASGI one, so that the
figures are the protocol's and the loop's, not the model's.

    python benchmarks/serve_connections.py --requests 500 --idle 256
"""

import argparse
import socket
import statistics
import threading
import time

import httpx
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


def rate(url: str, requests: int, fresh: bool) -> tuple[float, float]:
    """(requests a second, median ms) of `requests` sequential GETs."""
    times = []
    with httpx.Client() as client:
        for _ in range(requests):
            started = time.perf_counter()
            if fresh:
                httpx.get(url).raise_for_status()
            else:
                client.get(url).raise_for_status()
            times.append(time.perf_counter() - started)
    return requests / sum(times), statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--idle", type=int, default=256)
    args = parser.parse_args()
    print("| protocol | connections | requests/s | median ms |\n|---|---|---|---|")
    for name, http in (("uvicorn h11", H11Protocol), ("klein", Protocol.factory(ServeOptions()))):
        server, url = serving(http)
        rate(url, 20, False)  # warm-up
        for fresh in (True, False):
            per_second, median = rate(url, args.requests, fresh)
            kind = "new each request" if fresh else "one kept alive"
            print(f"| {name} | {kind} | {per_second:,.0f} | {median:.2f} |")
        if name == "klein":
            host, port = url.removeprefix("http://").split(":")
            idle = [socket.create_connection((host, int(port))) for _ in range(args.idle)]
            per_second, median = rate(url, args.requests, True)
            print(
                f"| {name}, {args.idle} idle sockets open | new each request | {per_second:,.0f} | {median:.2f} |"
            )
            for sock in idle:
                sock.close()
        server.should_exit = True


if __name__ == "__main__":
    main()
