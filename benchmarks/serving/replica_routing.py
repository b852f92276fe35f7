"""Reference-set affinity of `klein serve --replicas N` against Serve's default routing.

For each routing (`references`: Serve's model multiplexing keyed by set id; `load`: its default router,
power of two choices over queue lengths), starts `klein serve --replicas N --routing R` on a local Ray
(demo checkpoint), uploads --sets reference sets (POST /v1/references, which encodes each on one
replica), each followed at once by a generation with it, then sends the other --repeats - 1 generations
per set, by id, interleaved over the sets, from --clients concurrent clients. Prints, per routing: cache hits of those generations, and reference encodings in
all (uploads + misses; one per set is the least possible).

    python benchmarks/serving/replica_routing.py --replicas 2 --sets 4 --repeats 10 --clients 1

With --loras K it also prints LoRA slot hits: a stream of --requests requests each naming one of K LoRAs
(in turn, or at random), routed by klein's decision (`klein.serve.replicas.affinity.ranks`, replayed here
without Ray, each request going to the first replica it ranks) against round-robin and random; a replica's
slots are modelled as they work (`Holdings`: the 4 most recently used). A hit is a LoRA already in a
slot of the replica it reaches (a miss writes the LoRA's factors to the device).

    python benchmarks/serving/replica_routing.py --replicas 2 --loras 6 --requests 200 --no-servers
"""

import argparse
import collections
import contextlib
import io
import os
import random
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

from klein.serve.replicas.affinity import Holdings, Homes, ranks, routing_key


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


def lora_hits(replicas: int, loras: int, requests: int, order: str, policy: str, seed: int = 0) -> int:
    """Slot hits of `requests` requests naming one of `loras` LoRAs each (`order`: "turns" or "random"),
    sent to `replicas` replicas by `policy` ("klein", "round-robin" or "random")."""
    rng, names = random.Random(seed), [f"lora{i}" for i in range(loras)]
    ids, homes, router, slots = list(range(replicas)), Homes(), Holdings(), Holdings()
    hits = 0
    for i in range(requests):
        name = names[i % loras] if order == "turns" else rng.choice(names)
        if policy == "klein":
            to = ranks(ids, routing_key(None, [name]), homes, router, rng)[0][0]
            router.sent(to, [name])
        else:
            to = i % replicas if policy == "round-robin" else rng.randrange(replicas)
        hits += slots.missing(to, [name]) == 0
        slots.sent(to, [name])
    return hits


def print_lora_hits(replicas: int, loras: int, requests: int) -> None:
    print(f"\n| {replicas} replicas, {loras} LoRAs, {requests} requests | klein | round-robin | random |")
    print("|---|---|---|---|")
    for order in ("turns", "random"):
        counts = [lora_hits(replicas, loras, requests, order, p) for p in ("klein", "round-robin", "random")]
        print(f"| LoRAs in {order}: slot hits | " + " | ".join(f"{c / requests:.0%}" for c in counts) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--sets", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--clients", type=int, default=1)
    parser.add_argument("--loras", type=int, default=0, help="also print LoRA slot hits over K LoRAs")
    parser.add_argument("--requests", type=int, default=200, help="requests of the LoRA slot replay")
    parser.add_argument("--no-servers", action="store_true", help="only the LoRA slot replay")
    args = parser.parse_args()
    if args.loras:
        print_lora_hits(args.replicas, args.loras, args.requests)
    if args.no_servers:
        return
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
