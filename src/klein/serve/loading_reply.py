"""While a server loads its model: its sockets already listen, and every connection is answered 503 in a
line of JSON, then closed. A port is taken the moment the server starts (a second server on it is refused
at once, exit 2, not after its own load), and a client learns the server is loading rather than finding
the port closed or its request hanging.

One thread answers one connection at a time without parsing it: the request's first bytes are read (a
client that keeps sending is read for `READ_SECONDS` at most), the answer written, the connection closed.
`GET /healthz` is answered `{"status": "loading"}` as a readiness probe reads it; any other request
OpenAI's error shape, code "loading", with `Retry-After`. Once the model is loaded the thread stops, and
the server takes the same sockets (connections waiting in their backlog are the server's)."""

from __future__ import annotations

import json
import selectors
import socket
import threading
import time

BACKLOG = 128
READ_SECONDS = 0.5
RETRY_SECONDS = 5
_MESSAGE = (
    "klein serve is loading its model: try again in a few seconds (GET /healthz answers 200 once it serves)"
)


def answer(first_bytes: bytes) -> bytes:
    """The whole HTTP/1.1 response to a request that starts with `first_bytes`."""
    health = first_bytes.split(b" ", 2)[:2] in ([b"GET", b"/healthz"], [b"HEAD", b"/healthz"])
    if health:
        body = {"status": "loading"}
    else:
        body = {"error": {"message": _MESSAGE, "type": "server_error", "param": None, "code": "loading"}}
    content = json.dumps(body).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(content)}\r\nretry-after: {RETRY_SECONDS}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + (b"" if first_bytes.startswith(b"HEAD ") else content)


class LoadingReply:
    """A context in which `sockets` (bound, `klein.serve.server.bind`) listen and are answered 503; left by an
    exception (the load failed), it closes them."""

    def __init__(self, sockets: list[socket.socket]):
        self.sockets = sockets
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="klein-loading-reply", daemon=True)

    def __enter__(self) -> LoadingReply:
        for sock in self.sockets:
            sock.listen(BACKLOG)
        self._thread.start()
        return self

    def __exit__(self, kind, *_) -> None:
        self._stop.set()
        self._thread.join()
        if kind is not None:  # the load failed: the port is let go, nothing will serve on it
            for sock in self.sockets:
                sock.close()

    def _run(self) -> None:
        with selectors.DefaultSelector() as selector:
            for sock in self.sockets:
                selector.register(sock, selectors.EVENT_READ)
            while not self._stop.is_set():
                for key, _ in selector.select(timeout=0.1):
                    if self._stop.is_set():
                        return  # the rest wait in the backlog for the server
                    self._reply(key.fileobj)

    def _reply(self, listening: socket.socket) -> None:
        try:
            # Non-blocking: another may have taken it (a client that gave up, a server already serving).
            listening.setblocking(False)
            connection, _ = listening.accept()
        except OSError:
            return
        finally:
            listening.setblocking(True)
        with connection:
            try:
                connection.settimeout(READ_SECONDS)
                try:
                    first = connection.recv(65536)
                except TimeoutError:
                    first = b""
                connection.sendall(answer(first))
                connection.shutdown(socket.SHUT_WR)
                # What it still sends is read (for READ_SECONDS at most) before closing: closed with bytes
                # unread, the connection is reset, and a client may lose the answer with it.
                deadline = time.monotonic() + READ_SECONDS
                while time.monotonic() < deadline and connection.recv(65536):
                    pass
            except OSError:
                pass  # the client went away
