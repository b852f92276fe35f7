"""What refusing non-finite weights costs (`klein.io.finite`): klein-4b's transformer (random bf16 weights at
its published shapes, 7.75 GB in the diffusers layout's 2 GiB shards) read and loaded with the check and
without it, its files in the page cache each time (read whole once first).

1. Every tensor read as the loaders read it (`TensorSource.get`) and dropped: the check's cost beside the
   read alone, holding one tensor at a time; and the seconds spent in the check itself, timed around it
   (on a busy machine the difference of two reads is mostly noise), and the check alone, each tensor
   checked three times in memory and the fastest counted.
2. The whole transformer loaded (`load_transformer`, bf16) onto JAX's default device, then dropped: the
   check's share of a load (it needs about 8 GB of memory beside the page cache).
3. For comparison, the check made in JAX instead, on the loaded weights (`jnp.isfinite(w).all()` per weight,
   stacks' bits viewed as bf16; timed the second time round, its programs compiled).

Each setting runs --repeats times, in turn with the other; the median is printed, and all of it as JSON.
"Without" is the reader with `klein.io.finite.checked` made to pass every array through.

    python benchmarks/checkpoints/finite_check.py [--root DIR] [--repeats 3] [--no-load]

Writes, once, DIR/klein-4b-transformer (default `$KLEIN_HOME/finite-check`): klein-4b's transformer beside
the demo's tiny VAE and text encoder, 7.8 GB.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
from flax import nnx

from klein.bench.configs import _transformer
from klein.io import demo, finite
from klein.io.paths import klein_home
from klein.io.safetensors import TensorSource
from klein.io.transformer_checkpoint import load_transformer
from klein.models.transformer_config import KLEIN_4B

SPEC = dataclasses.replace(demo.DEMO, transformer=_transformer(KLEIN_4B), dtype="bfloat16")
PREFIX = "diffusion_pytorch_model"


@contextmanager
def checking(on: bool, spent: list[float]):
    """The readers with the check (`on`), its seconds added to `spent`, or with it passing every array
    through."""
    checked = finite.checked

    def timed(array, path, key):
        start = time.perf_counter()
        try:
            return checked(array, path, key)
        finally:
            spent.append(time.perf_counter() - start)

    with mock.patch.object(finite, "checked", timed if on else lambda array, path, key: array):
        yield


def warm(folder: Path) -> int:
    """Read every file of `folder` whole (into the page cache); their bytes."""
    total = 0
    for path in sorted(folder.glob(f"{PREFIX}*.safetensors")):
        with open(path, "rb") as f:
            while chunk := f.read(64 << 20):
                total += len(chunk)
    return total


def read_all(folder: Path) -> float:
    source = TensorSource.from_folder(folder, PREFIX)
    start = time.perf_counter()
    for key in sorted(source.keys()):
        source.get(key)
    return time.perf_counter() - start


def check_alone(folder: Path, repeats: int = 3) -> float:
    """Seconds of the check on every tensor, each read once and checked `repeats` times, the fastest
    counted: what it costs where no other process takes the CPU from it."""
    source = TensorSource.from_folder(folder, PREFIX)
    total = 0.0
    for key in sorted(source.keys()):
        array = source.get(key)
        best = []
        for _ in range(repeats):
            start = time.perf_counter()
            finite.all_finite(array)
            best.append(time.perf_counter() - start)
        total += min(best)
    return total


def load(folder: Path) -> tuple[float, object]:
    start = time.perf_counter()
    model = load_transformer(folder, jnp.bfloat16)
    jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
    return time.perf_counter() - start, model


@jax.jit
def _finite(weight):
    if weight.dtype == jnp.uint16:  # a stack, stored as its bits (`klein.models.stacks.as_bits`)
        weight = jax.lax.bitcast_convert_type(weight, jnp.bfloat16)
    return jnp.isfinite(weight).all()


def on_device(model) -> float:
    """Seconds to check every floating weight of `model` in JAX, its programs compiled."""
    weights = [w for w in jax.tree.leaves(nnx.state(model)) if w.dtype in (jnp.uint16, jnp.bfloat16)]
    for _ in range(2):
        start = time.perf_counter()
        assert all(bool(_finite(w)) for w in weights)
        seconds = time.perf_counter() - start
    return seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", type=Path, default=klein_home() / "finite-check")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-load", action="store_true", help="time the reads only (step 1)")
    args = parser.parse_args(argv)
    home = demo.ensure_checkpoint(args.root / "klein-4b-transformer", SPEC)
    folder = home / "transformer"
    size = warm(folder)
    runs: dict[str, list[float]] = {}

    def record(what: str, on: bool, seconds: float, spent: list[float]) -> None:
        runs.setdefault(f"{what}, {'with' if on else 'without'} the check", []).append(seconds)
        if on:
            runs.setdefault(f"the check itself, in the {what}", []).append(sum(spent))

    for _ in range(args.repeats):
        for on in (True, False):
            with checking(on, spent := []):
                record("read", on, read_all(folder), spent)
    runs["the check alone, fastest of 3 per tensor"] = [check_alone(folder)]
    if not args.no_load:
        for _ in range(args.repeats):
            for on in (True, False):
                with checking(on, spent := []):
                    seconds, model = load(folder)
                record("load", on, seconds, spent)
                if not on and "check in JAX, after the load" not in runs:
                    runs["check in JAX, after the load"] = [on_device(model)]
                del model
    device = jax.devices()[0]
    print(f"klein-4b transformer, {size / 1e9:.2f} GB bf16, page cache warm; JAX on {device.device_kind}")
    print("| what | median s | GB/s | runs (s) |\n| --- | --- | --- | --- |")
    for what, seconds in runs.items():
        median = statistics.median(seconds)
        listed = ", ".join(f"{s:.2f}" for s in seconds)
        print(f"| {what} | {median:.2f} | {size / 1e9 / median:.1f} | {listed} |")
    print(json.dumps(dict(bytes=size, device=device.device_kind, seconds=runs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
