"""Reference-set affinity of `klein serve --replicas N` against Serve's default routing.

For each routing (`references`: Serve's model multiplexing keyed by set id; `load`: its default router,
power of two choices over queue lengths), starts `klein serve --replicas N --routing R` on a local Ray
(demo checkpoint), uploads --sets reference sets (POST /v1/references, which encodes each on one
replica), each followed at once by a generation with it, then sends the other --repeats - 1 generations
per set, by id, interleaved over the sets, from --clients concurrent clients. Prints, per routing: cache hits of those generations, and reference encodings in
all (uploads + misses; one per set is the least possible).

    python benchmarks/replica_routing.py --replicas 2 --sets 4 --repeats 10 --clients 1
"""

import argparse
import collections
import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import PIL.Image


def picture(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    PIL.Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


@contextlib.contextmanager
def server(replicas: int, routing: str):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "klein.cli.main", "serve", "--port", str(port), "--max-queue", "64"]
    command += ["--replicas", str(replicas), "--routing", routing]
    log = tempfile.TemporaryFile("w+")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and process.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        else:
            log.seek(0)
            raise RuntimeError(f"klein serve did not start:\n{log.read()}")
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)


def run(url: str, sets: int, repeats: int, clients: int) -> tuple[collections.Counter, int]:
    """(hits and misses of the generations, encodings done by the uploads). Each set is uploaded and
    used at once (its home must be known the moment it is chosen), then used `repeats - 1` more times,
    interleaved with the other sets, from `clients` concurrent clients."""
    encoded, ids = 0, []
    cache = collections.Counter()
    for s in range(sets):
        upload = httpx.post(
            url + "/v1/references", files=[("image", (f"{s}.png", picture(s), "image/png"))], timeout=120
        )
        ids.append(upload.json()["id"])
        encoded += not upload.json()["cached"]
        cache[generate(url, ids[s], s)] += 1
    order = [ids[i % sets] for i in range(sets * (repeats - 1))]
    with ThreadPoolExecutor(clients) as pool:
        cache.update(pool.map(lambda i: generate(url, order[i], sets + i), range(len(order))))
    return cache, encoded


def generate(url: str, key: str, seed: int) -> str:
    """One generation with the set `key`: "hit" or "miss" in the replica's reference cache."""
    body = {"prompt": f"p{seed}", "size": "64x64", "references": key, "seed": seed, "num_inference_steps": 2}
    response = httpx.post(url + "/v1/images/generations", json=body, timeout=300)
    response.raise_for_status()
    return response.json()["klein"]["references"]["cache"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--sets", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--clients", type=int, default=1)
    args = parser.parse_args()
    print("| routing | clients | generations | cache hits | hit rate | reference encodings |")
    print("|---|---|---|---|---|---|")
    for routing in ("references", "load"):
        with server(args.replicas, routing) as url:
            cache, encoded = run(url, args.sets, args.repeats, args.clients)
        total = sum(cache.values())
        print(
            f"| {routing} | {args.clients} | {total} | {cache['hit']} | {cache['hit'] / total:.0%} "
            f"| {encoded + cache['miss']} |"
        )


if __name__ == "__main__":
    main()
