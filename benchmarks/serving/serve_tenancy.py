"""What one API key of a `klein serve` can learn of another's work, and what another's abandoned work costs it.

Starts `klein serve` (demo checkpoint) with two keys, A and B. Prompts: A sends a prompt, then B sends a
prompt nobody sent, A's prompt, and its own again; prints the `text` stage of B's three answers
(`klein.timings`): a prompt cache shared by keys answers A's prompt as fast as B's own repeat. A client
that leaves: A sends a synchronous --side^2, n=2, --steps request and disconnects --leave-after seconds
later; B's 64^2 request, sent a second after A's, waits behind it. Prints how long B waited and the
denoising steps the server ran (`klein_steps_total`, A's and B's together).

    python benchmarks/serving/serve_tenancy.py [--side 1024] [--steps 12] [--leave-after 3]
"""

import argparse
import json
import socket
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from served import klein_serve

KEYS = {"A": "alpha-bench-key", "B": "beta-bench-key"}


def generate(url: str, key: str, **fields) -> float:
    """Milliseconds of the `text` stage of a generation of `key`'s."""
    body = {"size": "64x64", "num_inference_steps": 1, "seed": 1, **fields}
    headers = {"Authorization": f"Bearer {KEYS[key]}"}
    answer = httpx.post(url + "/v1/images/generations", json=body, headers=headers, timeout=600)
    answer.raise_for_status()
    return answer.json()["klein"]["timings"]["text"] * 1000


def steps_run(url: str) -> float:
    headers = {"Authorization": f"Bearer {KEYS['A']}"}
    lines = httpx.get(url + "/metrics", headers=headers, timeout=30).text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith("klein_steps_total "))


def leave(url: str, body: dict) -> socket.socket:
    """A synchronous request of A's, sent on a socket the caller closes to leave."""
    data = json.dumps(body)
    host, port = url.removeprefix("http://").split(":")
    client = socket.create_connection((host, int(port)))
    head = (
        f"POST /v1/images/generations HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEYS['A']}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    client.sendall((head + data).encode())
    return client


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--side", type=int, default=1024, help="A's long request's side in px")
    parser.add_argument("--steps", type=int, default=12, help="A's long request's steps")
    parser.add_argument("--leave-after", type=float, default=3.0, help="seconds before A's client leaves")
    parser.add_argument("--rounds", type=int, default=3, help="prompt probes")
    args = parser.parse_args()
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as keys:
        keys.write("\n".join(KEYS.values()) + "\n")
        keys.flush()
        with klein_serve("--api-key-file", keys.name) as (_, url):
            generate(url, "B", prompt="B's first prompt")  # compiled, and B's negative prompt cached
            for i in range(args.rounds):
                generate(url, "A", prompt=f"A's prompt {i}")
                fresh = generate(url, "B", prompt=f"nobody's prompt {i}")
                alphas = generate(url, "B", prompt=f"A's prompt {i}")
                again = generate(url, "B", prompt=f"A's prompt {i}")
                print(
                    f"B's text stage: a fresh prompt {fresh:.2f} ms, A's prompt {alphas:.2f} ms, its own again {again:.2f} ms"
                )
            long = {"prompt": "a long one", "size": f"{args.side}x{args.side}", "n": 2, "seed": 3}
            generate(url, "A", **long, num_inference_steps=1)  # its programs compiled, as on a warm server
            before = steps_run(url)
            client = leave(url, {**long, "num_inference_steps": args.steps})
            time.sleep(1)
            with ThreadPoolExecutor(1) as pool:
                started = time.perf_counter()
                waiting = pool.submit(generate, url, "B", prompt="a small one")
                time.sleep(args.leave_after - 1)
                client.close()
                waiting.result()
                waited = time.perf_counter() - started
            print(
                f"B's 64^2 request answered in {waited:.1f} s; A's client left at {args.leave_after:g} s; "
                f"steps run: {steps_run(url) - before:.0f} (A asked {args.steps}, B 1)"
            )


if __name__ == "__main__":
    main()
