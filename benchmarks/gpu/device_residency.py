"""On an accelerator: does each residency policy run a full-size checkpoint within a card's memory, how
much device memory does it take, what does moving the models cost, and are the images the same?

For each --policies entry, one fresh process (so that the device's peak counter starts at zero, and the
card size applies from the start):
  1. loads the pipeline (`load_pipeline(DIR, residency=POLICY)`) with the device's allocator capped at
     --card-gib (`XLA_PYTHON_CLIENT_MEM_FRACTION`), as on a card of that size;
  2. generates one edit, --size px square from one reference of the same size, --steps steps, twice with
     two prompts: the first call compiles, the second is the warm one an interactive user waits for
     (under `sequential` it brings the text encoder back for the new prompt);
  3. prints the device's peak bytes in use (`memory_stats()["peak_bytes_in_use"]`), the cap, the load and
     call times and the stage times, and saves the image (float32).
Then the parent compares every policy's image with the first policy's (max abs difference) and writes a
table and JSON.

The checkpoint folder is one that `benchmarks/checkpoints/real_size.py --write-only` writes (full size, random).

    python benchmarks/gpu/device_residency.py --model /data/real-size/klein-9b-kv --card-gib 24 \
        --policies auto all --out device-residency.json
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

GiB = 2**30
PROMPTS = ("put a hat on it", "put a red hat on it")  # the second call encodes a new prompt too


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, required=True, help="checkpoint folder (diffusers layout)")
    parser.add_argument(
        "--policies", nargs="+", default=["auto", "all"], help="residency policies, one process each"
    )
    parser.add_argument(
        "--card-gib",
        type=float,
        default=None,
        help="cap the device's allocator at this many GiB, as on a smaller card (default: no cap)",
    )
    parser.add_argument("--size", type=int, default=1024, help="output and reference side in px")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("device-residency.json"))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def child(args: argparse.Namespace) -> None:
    """One policy's run; prints one JSON line."""
    import jax
    import numpy as np
    import PIL.Image

    import klein

    rng = np.random.default_rng(0)
    reference = PIL.Image.fromarray(rng.integers(0, 256, (args.size, args.size, 3), dtype=np.uint8))
    start = time.perf_counter()
    pipe = klein.load_pipeline(args.model, residency=args.child)
    loaded = time.perf_counter() - start
    calls = []
    for prompt in PROMPTS:
        start = time.perf_counter()
        out = pipe(
            prompt=prompt,
            image=[reference],
            height=args.size,
            width=args.size,
            num_inference_steps=args.steps,
            seed=0,
            output_type="np",
        )
        calls.append(dict(seconds=time.perf_counter() - start, stages=out.timings))
    stats = jax.local_devices()[0].memory_stats() or {}
    image_path = args.out.with_name(f"{args.out.stem}-{args.child}.npy")
    np.save(image_path, np.asarray(out.images, np.float32))
    result = dict(
        policy=args.child,
        chose=pipe.residency,
        device=str(jax.local_devices()[0].device_kind),
        peak_bytes=stats.get("peak_bytes_in_use"),
        limit_bytes=stats.get("bytes_limit"),
        load_seconds=loaded,
        calls=calls,
        image=str(image_path),
    )
    print("RESULT " + json.dumps(result), flush=True)


def run_policy(args: argparse.Namespace, policy: str, total_bytes: int | None) -> dict:
    env = dict(os.environ)
    if args.card_gib and total_bytes:
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{args.card_gib * GiB / total_bytes:.4f}"
    command = [sys.executable, __file__, "--model", str(args.model), "--size", str(args.size)]
    command += ["--steps", str(args.steps), "--out", str(args.out), "--child", policy]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        tail = (done.stderr or done.stdout)[-2000:]
        print(f"{policy}: exit {done.returncode}\n{tail}", flush=True)
        return dict(policy=policy, exit_code=done.returncode, error=tail)
    result = dict(json.loads(lines[-1][len("RESULT ") :]), exit_code=0)
    warm = result["calls"][-1]
    print(
        f"{policy}: chose {result['chose']}, peak {gib(result['peak_bytes'])} GiB of "
        f"{gib(result['limit_bytes'])}, load {result['load_seconds']:.1f} s, first call "
        f"{result['calls'][0]['seconds']:.2f} s, warm call {warm['seconds']:.2f} s {warm['stages']}",
        flush=True,
    )
    return result


def gib(count: int | None) -> str:
    return "?" if count is None else f"{count / GiB:.2f}"


def device_bytes() -> int | None:
    """The whole device's memory, from a process that caps nothing and allocates nothing."""
    code = "import jax; print((jax.local_devices()[0].memory_stats() or {}).get('bytes_limit', 0))"
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", XLA_PYTHON_CLIENT_MEM_FRACTION="1.0")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    return int(done.stdout.split()[-1]) if done.returncode == 0 and done.stdout.split() else None


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        child(args)
        return
    import numpy as np

    total = device_bytes() if args.card_gib else None
    results = [run_policy(args, policy, total) for policy in args.policies]
    images = [np.load(r["image"]) for r in results if r.get("image")]
    for result, image in zip([r for r in results if r.get("image")], images, strict=True):
        result["max_abs_vs_first"] = float(np.abs(image - images[0]).max())
        print(f"{result['policy']}: max |image - first policy's| = {result['max_abs_vs_first']:.3g}")
    args.out.write_text(json.dumps(dict(card_gib=args.card_gib, device_bytes=total, runs=results), indent=1))


if __name__ == "__main__":
    main()
