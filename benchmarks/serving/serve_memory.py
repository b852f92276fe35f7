"""A long-running `klein serve`'s memory: its RSS over many synchronous edits with fresh references.

Starts `klein serve` (demo checkpoint unless --model), warms it up (every program compiled, the caches
filled once), then sends --requests synchronous edits, each with --refs fresh reference images of --side
px (a cache miss every time) and a small output, one client at a time. Prints the server's RSS (VmRSS of
/proc/PID/status) after the warm-up and every --every requests, the growth, and the bytes each store
holds (/metrics). A server that keeps finished requests grows by their inputs (~12 MiB an edit with four
512^2 references); a flat one stays within its caches' budgets.

    python benchmarks/serving/serve_memory.py --requests 200 --refs 4 --side 512 [--cache-bytes 64MiB]
"""

import argparse
import contextlib
import time

import httpx
from served import klein_serve, picture

MIB = 2**20


def rss(pid: int) -> int:
    """Resident bytes of process `pid`."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def edit(url: str, images: list[bytes], args, seed: int) -> None:
    fields = {"prompt": "a cat", "size": f"{args.out}x{args.out}", "seed": str(seed)}
    fields["num_inference_steps"] = str(args.steps)
    response = httpx.post(
        url + "/v1/images/edits", data=fields, files=[("image", i) for i in images], timeout=600
    )
    response.raise_for_status()


@contextlib.contextmanager
def server(args):
    flags = ["--model", args.model] if args.model else []
    flags += ["--cache-bytes", args.cache_bytes] if args.cache_bytes else []
    with klein_serve(*flags) as (process, url):
        yield process.pid, url


def stores(url: str) -> str:
    """The bytes each store holds, from /metrics."""
    lines = httpx.get(url + "/metrics").text.splitlines()
    held = [line for line in lines if line.startswith("klein_") and line.split(" ")[0].endswith("_bytes")]
    return "\n".join(f"  {line}" for line in held if "budget" not in line)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="checkpoint for the started server (default: demo)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--refs", type=int, default=4, help="fresh reference images per request")
    parser.add_argument("--side", type=int, default=512, help="reference side, px")
    parser.add_argument("--out", type=int, default=64, help="output side, px")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=10, help="edits before the baseline reading")
    parser.add_argument("--every", type=int, default=20, help="print the RSS every N requests")
    parser.add_argument("--cache-bytes", help="the started server's --cache-bytes (default: its own)")
    args = parser.parse_args()
    seeds = iter(range(10**6))
    with server(args) as (pid, url):
        for i in range(args.warmup):
            edit(url, [picture(next(seeds), args.side) for _ in range(args.refs)], args, i)
        start = rss(pid)
        print(
            f"{args.requests} edits, {args.refs} fresh {args.side}^2 references each, {args.out}^2 output, "
        )
        print(f"{args.steps} step(s); RSS after {args.warmup} warm-up edits: {start / MIB:.0f} MiB")
        print(f"{'requests':>9}{'RSS MiB':>10}{'growth MiB':>12}")
        started = time.perf_counter()
        for i in range(1, args.requests + 1):
            edit(url, [picture(next(seeds), args.side) for _ in range(args.refs)], args, i)
            if i % args.every == 0 or i == args.requests:
                now = rss(pid)
                print(f"{i:>9}{now / MIB:>10.0f}{(now - start) / MIB:>12.0f}", flush=True)
        print(f"{args.requests / (time.perf_counter() - started):.2f} requests/s")
        print("bytes held by each store (/metrics):")
        print(stores(url))


if __name__ == "__main__":
    main()
