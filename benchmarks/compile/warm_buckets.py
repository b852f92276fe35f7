"""What warm buckets first costs and saves on a server's first requests: the demo checkpoint warmed as
`klein serve` warms by default (1024x1024, 0 to 4 references, one image, an inpainting), then the photos
of issue 62 (edits with 512x384, 640x480, 768x1024 and 1000x667 photos, two images of one, a 1024x768
text-to-image), each once on the warm buckets (its own not warm yet), then, its own compiled behind,
again: per request the tokens its steps ran over and those of its own bucket, the wall time, and the
time spent compiling in the foreground (XLA's, this thread's) with the programs built there.

    JAX_PLATFORMS=cpu PYTHONPATH=src:. python benchmarks/compile/warm_buckets.py [--steps 4]

The demo's transformer is tiny: its step costs little at any bucket, so the time columns show the
foreground compiles that remain (the VAE's and small programs, at each new size) rather than the padding's
cost, which the token columns give (and `benchmarks/compile/buckets.py` times per step at klein-4b's width).
"""

from __future__ import annotations

import argparse
import os
import platform
import time
import warnings

import numpy as np
import PIL.Image

from klein.pipeline import warmup
from klein.pipeline.compilations import Compilations
from klein.pipeline.loading import load_pipeline

REQUESTS = {
    "edit 512x384": dict(photo=(512, 384)),
    "edit 512x384, 2 images": dict(photo=(512, 384), num_images_per_prompt=2),
    "edit 640x480": dict(photo=(640, 480)),
    "edit 768x1024": dict(photo=(768, 1024)),
    "edit 1000x667, 2 images": dict(photo=(1000, 667), num_images_per_prompt=2),
    "text-to-image 1024x768": dict(width=1024, height=768),
}


def photo(width: int, height: int) -> PIL.Image.Image:
    pixels = np.random.default_rng(width * height).integers(0, 256, (height // 8, width // 8, 3), np.uint8)
    return PIL.Image.fromarray(pixels).resize((width, height), PIL.Image.BILINEAR)


def run(pipe, name: str, steps: int) -> str:
    request = dict(REQUESTS[name])
    if "photo" in request:
        request["image"] = [photo(*request.pop("photo"))]
    start = time.perf_counter()
    with Compilations() as built:
        out = pipe(prompt="a hat", seed=3, num_inference_steps=steps, **request)
    seconds = time.perf_counter() - start
    ran = out.buckets or {}
    tokens = lambda bucket: f"{bucket[0]} x ({bucket[1]:,} + {bucket[2]:,})" if bucket else "-"  # noqa: E731
    programs = ", ".join(sorted(set(built.names))) or "none"
    parts = f", in {ran['parts']} parts" if ran.get("parts") else ""
    return (
        f"| {name} | {tokens(ran.get('bucket'))}{parts} | {tokens(ran.get('own_bucket'))} | "
        f"{ran.get('padded_tokens', 0):,} | {seconds:.2f} s | {out.timings.get('compile', 0.0):.2f} s | "
        f"{len(built)}: {programs} |"
    )


def cpu() -> str:
    """The CPU's model name (Linux), else the machine's kind."""
    try:
        with open("/proc/cpuinfo") as info:
            lines = info.read().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    pipe = load_pipeline()
    pipe.set_progress_bar_config(disable=True)
    start = time.perf_counter()
    warmup.warm(pipe, warmup.at_sizes(warmup.REFERENCES, (1,), ((1024, 1024),)))
    print(f"{cpu()}, {os.cpu_count()} cores; demo checkpoint; warm-up {time.perf_counter() - start:.0f} s")
    header = "| request | steps ran over (batch x (image + references)) | own bucket | padded tokens | wall | foreground compile | foreground programs |"
    for phase in ("first, on the warm buckets", "again, on its own (compiled behind)"):
        print(f"\n{phase}\n\n{header}\n|---|---|---|---|---|---|---|")
        for name in REQUESTS:
            print(run(pipe, name, args.steps), flush=True)
        start = time.perf_counter()
        pipe.warm_buckets.drain()
        print(
            f"\ncompiled behind: {dict(pipe.warm_buckets.counts)}, drained after {time.perf_counter() - start:.1f} s"
        )


if __name__ == "__main__":
    main()
