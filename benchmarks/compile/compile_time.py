"""Compile time: of one transformer forward, layers scanned vs fully unrolled; and what a person waits
for, from a process's start to its first image and to its second (a new prompt), cold and warm
persistent cache, with and without compiling ahead.

Compile time depends on depth and graph structure, hardly on width, so the real 9b layer count is
measured at a CPU-friendly width. Random weights; no checkpoint needed.

    python benchmarks/compile/compile_time.py --layers 8 24 --heads 2 --tokens 1024 --text 512

--first-images: each row a fresh process (`python -c`, timed from before it starts) on --model (default:
the demo checkpoint) editing one --size^2 reference at --size^2; its cache folder empty (cold) or as the
cold rows left it (warm); `warm` rows load with `load_pipeline(warm=...)` of 0 and 1 references and an
inpainting at that size (`klein.pipeline.warmup`), as `klein serve` compiles ahead before it is ready.
Each row also counts the programs each image built (`klein.pipeline.compilations`: lowered, whether XLA
then compiled them or read them from the persistent cache).

    python benchmarks/compile/compile_time.py --first-images --size 512

--geometry klein-4b: the same rows on klein-4b's geometry instead of the demo's, random bf16 weights
written once under $KLEIN_HOME/geometry (8.5 GB): the transformer at klein-4b's width (hidden 3072, 24
heads, SwiGLU 9216) with 1 double + 2 single blocks instead of 5 + 20, the whole Qwen3-4B and the real
VAE. Layers are scanned, so compiling does not grow with depth (the scan / unrolled rows above); running
does, so its image times are those of that shallower transformer.

    python benchmarks/compile/compile_time.py --first-images --geometry klein-4b --size 512
"""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from klein.bench.configs import QWEN3_4B, REAL_VAE, _transformer
from klein.io import demo
from klein.io.paths import klein_home
from klein.models import transformer as T
from klein.models.rope import rope_tables
from klein.models.transformer_config import KLEIN_4B, KLEIN_9B

# klein-4b's geometry at a depth this CPU runs in minutes (see the module docstring).
GEOMETRIES = {
    "klein-4b": demo.RandomCheckpoint(
        _transformer(dataclasses.replace(KLEIN_4B, num_layers=1, num_single_layers=2)),
        REAL_VAE,
        QWEN3_4B,
        pipeline="Flux2KleinPipeline",
        dtype="bfloat16",
    )
}


def measure(cfg, unroll, n_img, n_txt):
    model = T.Flux2Transformer(cfg, rngs=nnx.Rngs(0))
    model.scan_unroll = unroll
    graphdef, state = nnx.split(model)
    side = int(n_img**0.5)
    img_ids = np.stack(np.meshgrid([0], np.arange(side), np.arange(side), [0], indexing="ij"), -1).reshape(
        -1, 4
    )
    txt_ids = np.stack([np.zeros(n_txt), np.zeros(n_txt), np.zeros(n_txt), np.arange(n_txt)], -1)
    ropes = [rope_tables(i, cfg.axes_dims_rope, cfg.rope_theta) for i in (img_ids, txt_ids)]
    args = (
        jnp.ones((1, side * side, cfg.in_channels)),
        jnp.ones((1, n_txt, cfg.joint_attention_dim)),
        jnp.full((1,), 0.5),
        *ropes,
    )

    @jax.jit
    def run(state, *args):
        return T.forward(nnx.merge(graphdef, state), *args)

    start = time.perf_counter()
    compiled = run.lower(state, *args).compile()
    compile_s = time.perf_counter() - start
    compiled(state, *args).block_until_ready()
    start = time.perf_counter()
    compiled(state, *args).block_until_ready()
    return compile_s, time.perf_counter() - start


CHILD = """
import json, sys, time
from klein.pipeline import warmup
from klein.pipeline.compilations import Compilations
from klein.pipeline.loading import load_pipeline
import PIL.Image
started, model, size, warm = float(sys.argv[1]), sys.argv[2] or None, int(sys.argv[3]), sys.argv[4] == "1"
shapes = warmup.shapes(references=1, height=size, width=size) if warm else False
pipe = load_pipeline(model, warm=shapes)
pipe.set_progress_bar_config(disable=True)
ready = time.time()
picture = PIL.Image.new("RGB", (size, size), (90, 140, 60))
with Compilations() as first_built:
    pipe(prompt="put a hat on it", image=[picture], seed=1)
first = time.time()
with Compilations() as second_built:
    pipe(prompt="a red scarf instead, in falling snow", image=[picture], seed=2)
second = time.time()
times = dict(ready=ready - started, first=first - started, second=second - first)
print(json.dumps(dict(times, first_built=len(first_built), second_built=len(second_built))))
"""


def first_images(model: str | None, size: int) -> None:
    """One fresh process per row: seconds to ready, to the first image, and for the second."""
    print(f"{model or 'demo'}, one {size}x{size} reference, {size}x{size} output, {os.cpu_count()} CPUs")
    print(
        "| cache | compiled ahead | start to ready | start to first image | second image (new prompt) "
        "| programs built: first image / second |"
    )
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as home:
        if model is None:  # the demo's weights written before any row, not in the first one's time
            env = dict(os.environ, KLEIN_HOME=home)
            subprocess.run(
                [sys.executable, "-c", "from klein.io import demo; demo.ensure_demo()"], env=env, check=True
            )
        for cache in ("cold", "warm"):
            for warm in (False, True):
                folder = os.path.join(home, f"xla-{'ahead' if warm else 'plain'}")
                env = dict(os.environ, KLEIN_HOME=home, JAX_COMPILATION_CACHE_DIR=folder)
                args = [str(time.time()), model or "", str(size), "1" if warm else "0"]
                out = subprocess.run(
                    [sys.executable, "-c", CHILD, *args], env=env, capture_output=True, text=True, check=False
                )
                if out.returncode:
                    raise SystemExit(out.stderr[-3000:])
                t = json.loads(out.stdout.strip().splitlines()[-1])
                ahead = "yes" if warm else "no"
                print(
                    f"| {cache} | {ahead} | {t['ready']:.1f} s | {t['first']:.1f} s | {t['second']:.2f} s "
                    f"| {t['first_built']} / {t['second_built']} |",
                    flush=True,
                )


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--first-images", action="store_true", help="time fresh processes to their images")
    parser.add_argument("--model", help="with --first-images: a checkpoint (default: the demo)")
    parser.add_argument("--size", type=int, default=512, help="with --first-images: the side in px")
    parser.add_argument(
        "--geometry", choices=tuple(GEOMETRIES), help="with --first-images: a random checkpoint of this shape"
    )
    parser.add_argument("--layers", type=int, nargs=2, default=(8, 24), help="double and single blocks")
    parser.add_argument("--heads", type=int, default=2, help="heads of 128 channels")
    parser.add_argument("--tokens", type=int, default=1024, help="image tokens (a square number)")
    parser.add_argument("--text", type=int, default=512, help="text tokens")
    args = parser.parse_args()
    if args.first_images:
        model = args.model
        if args.geometry:
            home = klein_home() / "geometry" / f"{args.geometry}-shallow"
            model = str(demo.ensure_checkpoint(home, GEOMETRIES[args.geometry]))
        first_images(model, args.size)
        return
    cfg = dataclasses.replace(
        KLEIN_9B,
        num_layers=args.layers[0],
        num_single_layers=args.layers[1],
        num_attention_heads=args.heads,
        joint_attention_dim=3 * 128 * args.heads,
    )
    print(
        f"layers {args.layers}, width {cfg.hidden}, {args.tokens} image + {args.text} text tokens, {jax.devices()[0]}"
    )
    for name, unroll in [("scan", 1), ("unrolled", True)]:
        compile_s, run_s = measure(cfg, unroll, args.tokens, args.text)
        print(f"{name:9s} compile {compile_s:6.2f} s   run {run_s * 1000:8.1f} ms")


if __name__ == "__main__":
    main()
