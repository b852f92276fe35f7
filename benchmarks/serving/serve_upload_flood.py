"""Many large uploads at once to a busy `klein serve`: its peak memory, and how each client was answered.

Starts `klein serve` (demo checkpoint), keeps its worker busy with a long job, then has --clients clients
each POST one edit of four --side^2 PNGs of noise (12 MiB each at 2048) at the same moment, and waits for
every answer. Prints the server's RSS before, its peak (VmHWM of /proc/PID/status) after, and the answers
by status, each with the bytes its client had sent when the answer came: a request admitted from its
headers reads its body (then waits in the queue); one refused (429: the queue, the body budget) is told
before its body is sent.

    python benchmarks/serving/serve_upload_flood.py --clients 30 --side 2048
"""

import argparse
import collections
import socket
import threading
import time

import httpx
from served import klein_serve, picture

MIB = 2**20
WAIT = 10.0
"""Seconds a client whose body was read waits for an answer: longer, it is queued behind the long job."""
LONG = {"prompt": "keeps the worker busy", "size": "1024x1024", "num_inference_steps": 50, "seed": 1}


def status_of(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as status:
        return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in status if line.startswith("Vm")}


def body_of(images: list[bytes]) -> bytes:
    parts = [b'--b\r\nContent-Disposition: form-data; name="prompt"\r\n\r\na cat\r\n']
    for image in images:
        head = b'--b\r\nContent-Disposition: form-data; name="image"; filename="a.png"\r\n'
        parts.append(head + b"Content-Type: image/png\r\n\r\n" + image + b"\r\n")
    return b"".join(parts) + b"--b--\r\n"


def upload(url: str, body: bytes, start: threading.Event, answers: list) -> None:
    """POST `body` in 1 MiB pieces, reading any answer between them; (status, bytes sent when it came)."""
    host, port = url.removeprefix("http://").split(":")
    head = (
        f"POST /v1/images/edits HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n"
        "Content-Type: multipart/form-data; boundary=b\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=600) as sock:
        start.wait()
        sock.sendall(head)
        sent, received = 0, b""
        sock.setblocking(False)
        while sent < len(body) and not received:
            try:
                received = sock.recv(4096)
            except BlockingIOError:
                pass
            try:
                sent += sock.send(body[sent : sent + MIB])
            except BlockingIOError:
                time.sleep(0.001)
            except OSError:
                break
        sock.settimeout(WAIT)
        try:
            while b"\r\n" not in received and (chunk := sock.recv(4096)):
                received += chunk
        except TimeoutError:
            answers.append(("read whole, queued", sent))
            return
    answers.append((received.split(b" ")[1].decode() if received else "closed", sent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=30)
    parser.add_argument("--side", type=int, default=2048)
    args = parser.parse_args()
    body = body_of([picture(seed, args.side) for seed in range(4)])
    print(f"each upload: {len(body) / MIB:.1f} MiB")
    with klein_serve("--max-pixels", str(args.side**2)) as (process, url):
        job = httpx.post(url + "/v1/jobs", json=LONG).json()["id"]
        with httpx.stream("GET", f"{url}/v1/jobs/{job}/events", timeout=600) as events:
            next(line for line in events.iter_lines() if line == "event: step")  # compiled, stepping
        with open(f"/proc/{process.pid}/clear_refs", "w") as clear:
            clear.write("5")  # the peak (VmHWM) counts from here
        before = status_of(process.pid)["VmRSS"]
        start, answers = threading.Event(), []
        clients = [
            threading.Thread(target=upload, args=(url, body, start, answers)) for _ in range(args.clients)
        ]
        for client in clients:
            client.start()
        started = time.perf_counter()
        start.set()
        for client in clients:
            client.join()
        took = time.perf_counter() - started
        peak = status_of(process.pid)["VmHWM"]
    print(
        f"server RSS before: {before / MIB:,.0f} MiB, peak: {peak / MIB:,.0f} MiB; all answered in {took:.1f} s"
    )
    by_status = collections.defaultdict(list)
    for status, sent in answers:
        by_status[status].append(sent)
    for status, sent in sorted(by_status.items()):
        print(
            f"  {status}: {len(sent)} clients, sent {min(sent) / MIB:.1f}-{max(sent) / MIB:.1f} MiB "
            "when answered"
        )


if __name__ == "__main__":
    main()
