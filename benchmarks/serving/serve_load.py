"""Throughput and latency of `klein serve` under concurrent edits, with cold and with warm references.

Starts `klein serve` (demo checkpoint unless --model; or targets --url), compiles every shape once, then
runs two phases of --requests edits from --clients concurrent clients, each with --refs reference images:

- cold: every request sends new images (a cache miss: VAE encoding and, on KV checkpoints, the prefill);
- warm: every request sends the same images (a cache hit: only text, denoising and decoding run).

With --max-batch N the started server runs queued requests of one shape and reference set as one batch.

Prints requests/s and p50 / p95 latency per phase, and the server's cache counters.

    python benchmarks/serving/serve_load.py --clients 4 --requests 32 --size 256 --steps 4 --refs 2 [--max-batch 4]
"""

import argparse
import contextlib
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from served import klein_serve, picture


def edit(url: str, images: list[bytes], args, seed: int) -> float:
    """Seconds for one edit (raises on any status but 200)."""
    fields = {
        "prompt": "a cat in a hat",
        "size": "auto",
        "seed": str(seed),
        "num_inference_steps": str(args.steps),
    }
    started = time.perf_counter()
    response = httpx.post(
        url + "/v1/images/edits", data=fields, files=[("image", i) for i in images], timeout=600
    )
    response.raise_for_status()
    return time.perf_counter() - started


def phase(url: str, args, image_sets: list[list[bytes]]) -> dict:
    started = time.perf_counter()
    with ThreadPoolExecutor(args.clients) as pool:
        latencies = list(pool.map(lambda i: edit(url, image_sets[i], args, i), range(args.requests)))
    wall = time.perf_counter() - started
    cuts = statistics.quantiles(latencies, n=20)
    return {"throughput": args.requests / wall, "p50": statistics.median(latencies), "p95": cuts[18]}


@contextlib.contextmanager
def server(args):
    if args.url:
        yield args.url
        return
    flags = ["--max-queue", "256", "--max-batch", str(args.max_batch)]
    with klein_serve(*flags, *(["--model", args.model] if args.model else [])) as (_, url):
        yield url


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", help="an already running server (default: start one)")
    parser.add_argument("--model", help="checkpoint for the started server (default: demo)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--size", type=int, default=256, help="reference (and output) side, px")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--refs", type=int, default=2, help="reference images per request")
    parser.add_argument("--max-batch", type=int, default=1, help="the started server's --max-batch")
    args = parser.parse_args()
    with server(args) as url:
        same = [picture(seed, args.size) for seed in range(args.refs)]
        # Compiles every stage at this shape (and, batching, at the batch sizes that arise); leaves `same` cached.
        phase(
            url, argparse.Namespace(**{**vars(args), "requests": 4 * args.clients}), [same] * 4 * args.clients
        )
        fresh = [
            [picture(1000 + args.refs * i + j, args.size) for j in range(args.refs)]
            for i in range(args.requests)
        ]
        results = {"cold": phase(url, args, fresh), "warm": phase(url, args, [same] * args.requests)}
        counters = [
            line
            for line in httpx.get(url + "/metrics").text.splitlines()
            if "reference_cache_" in line or "batch" in line
        ]
    print(
        f"{args.clients} clients x {args.requests} requests, {args.refs} references of {args.size} px, "
        f"{args.steps} steps, --max-batch {args.max_batch}"
    )
    print(f"{'references':<12}{'req/s':>8}{'p50 s':>8}{'p95 s':>8}")
    for name, r in results.items():
        print(f"{name:<12}{r['throughput']:>8.2f}{r['p50']:>8.3f}{r['p95']:>8.3f}")
    print(f"warm / cold throughput: {results['warm']['throughput'] / results['cold']['throughput']:.2f}x")
    print("\n".join(line for line in counters if not line.startswith("#")))


if __name__ == "__main__":
    main()
