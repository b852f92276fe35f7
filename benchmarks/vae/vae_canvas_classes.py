"""What the VAE's canvas classes cost and save: a decode on its size's class of canvas
(`klein.models.vae_canvas.canvas_size`) against a decode at the image's exact size, and against a coarser
rule (multiples of 64 px up to 256, of 128 up to 1024, of 256 beyond), for photos of real sizes; and how
many programs the sizes people use need under each rule.

Per size: the seconds of compiling the decoder on that canvas (this process's CPU time: what a new size
costs once), and the best decode time over `--rounds` interleaved rounds, wall and this process's CPU
(a shared machine only adds time; its CPU seconds move less), with the canvas's pixels over the image's. Random weights: the time does not depend on them. The cut
canvas is checked against the exact decode (float32: summation order only).

    JAX_PLATFORMS=cpu PYTHONPATH=src:. python benchmarks/vae/vae_canvas_classes.py --vae demo --rounds 5 \
        [--sizes 992x656 640x480]
"""

from __future__ import annotations

import argparse
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from klein.models import vae as V
from klein.models import vae_canvas

VAES = {
    "demo": V.VAEConfig(block_out_channels=(16, 16, 32, 32), layers_per_block=1, norm_num_groups=8),
    "bench-cpu": V.VAEConfig(block_out_channels=(16, 32, 64, 64), norm_num_groups=16),
    "flux2": V.VAEConfig(),
}
SIZES = ((656, 992), (480, 640), (1040, 784), (272, 400))
"""(height, width) px: a 1000x667 photo once prepared (multiples of 16), a 640x480 one, one just past 1024
px a side, a small one."""
EDGES = range(512, 1537, 16)
"""Sides of the outputs people use (docs/design/compiling.md, token buckets): every 16 px of 512 to 1536."""


def coarse_side(pixels: int) -> int:
    """The coarser rule, for comparison: multiples of 64 px up to 256, of 128 up to 1024, of 256 beyond."""
    step = 64 if pixels <= 256 else 128 if pixels <= 1024 else 256
    return -(-pixels // step) * step


def compiled(vae, latents, extent):
    """(the decoder compiled for `latents`' canvas, the process CPU seconds it took)."""
    graphdef, state = nnx.split(vae)

    def decode(state, latents, extent):
        return V.decode_latents_on_canvas(nnx.merge(graphdef, state), latents, extent)

    start = time.process_time()
    fn = jax.jit(decode).lower(state, latents, extent).compile()
    return (lambda: fn(state, latents, extent)), time.process_time() - start


def on_canvas(latents: np.ndarray, height: int, width: int) -> np.ndarray:
    """`latents` float[1, h, w, C] at the top left of a canvas of height x width px, zeros beyond."""
    canvas = np.zeros((1, height // 16, width // 16, latents.shape[-1]), np.float32)
    canvas[:, : latents.shape[1], : latents.shape[2]] = latents
    return canvas


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vae", choices=tuple(VAES), default="demo")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", nargs="+", default=[f"{w}x{h}" for h, w in SIZES], help="WxH px")
    args = parser.parse_args()
    cfg = VAES[args.vae]
    vae = V.AutoencoderKLFlux2(cfg, rngs=nnx.Rngs(0))
    channels = cfg.latent_channels * 4
    print(f"{args.vae} VAE on {platform.processor() or platform.machine()}, jax {jax.__version__}, float32")
    print(
        "| image px | canvas | canvas px / image px | compile s (CPU) | decode s (best) "
        "| decode CPU s (best) | cut vs exact |"
    )
    print("|---|---|---|---|---|---|---|")
    for width, height in (tuple(int(n) for n in size.split("x")) for size in args.sizes):
        latents = np.random.default_rng(0).standard_normal((1, height // 16, width // 16, channels))
        latents = latents.astype(np.float32)
        extent = jnp.asarray([height, width], jnp.int32)
        canvases = {
            "exact": (height, width),
            "class": vae_canvas.canvas_size(height, width),
            "coarse": (coarse_side(height), coarse_side(width)),
        }
        runs, compile_s, outputs = {}, {}, {}
        for name, (h, w) in canvases.items():
            z = jnp.asarray(on_canvas(latents, h, w))
            runs[name], compile_s[name] = compiled(vae, z, extent)
            outputs[name] = np.asarray(runs[name]())[:, :height, :width]
        best = {name: [float("inf")] * 2 for name in canvases}  # wall, CPU
        for round_ in range(args.rounds):
            for name in canvases if round_ % 2 == 0 else tuple(canvases)[::-1]:
                start, cpu = time.perf_counter(), time.process_time()
                runs[name]().block_until_ready()
                took = (time.perf_counter() - start, time.process_time() - cpu)
                best[name] = [min(pair) for pair in zip(best[name], took, strict=True)]
        scale = float(np.abs(outputs["exact"]).max())
        for name, (h, w) in canvases.items():
            drift = float(np.abs(outputs[name] - outputs["exact"]).max()) / scale
            (wall, cpu), (exact_wall, exact_cpu) = best[name], best["exact"]
            print(
                f"| {width}x{height} | {name} {w}x{h} | {h * w / (height * width):.3f} | "
                f"{compile_s[name]:.2f} | {wall:.3f} ({wall / exact_wall:.2f}x) | "
                f"{cpu:.3f} ({cpu / exact_cpu:.2f}x) | {drift:.1e} |"
            )
    sides = list(EDGES)
    rules = {"exact": lambda n: n, "class": vae_canvas.canvas_side, "coarse": coarse_side}
    print()
    print(
        "| rule | programs for every output of 512-1536 px a side (16 px steps) | mean canvas px / image px |"
    )
    print("|---|---|---|")
    for name, side in rules.items():
        classes = {(side(h), side(w)) for h in sides for w in sides}
        ratio = np.mean([side(h) * side(w) / (h * w) for h in sides for w in sides])
        print(f"| {name} | {len(classes)} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
