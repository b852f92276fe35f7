"""What a live preview costs: TAEF2 decoding one step's latents (`klein.pipeline.preview.Previewer`), per
output size, as milliseconds per frame; with `--vae`, the FLUX.2 VAE's decoder on the same latents beside
it (the released architecture, random weights: the time does not depend on them).

Each program is compiled once per size (the first frame of a size pays that, reported apart); the table
gives the best and the median of `--rounds` frames (a shared machine only ever adds time). A frame is
what a step callback waits for: the decode, the copy to the host and the conversion to a PIL image.

    python benchmarks/vae/taef2_preview.py --sizes 512 1024 --rounds 5 --vae
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from klein.models import vae as V
from klein.models.taef2 import TAEF2Decoder
from klein.pipeline.preview import Previewer


def timed(rounds: int, fn, *args) -> tuple[float, float, float]:
    """(first call, best, median) seconds of `fn(*args)` over `rounds` calls after the first."""
    start = time.perf_counter()
    fn(*args)
    first = time.perf_counter() - start
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return first, min(times), statistics.median(times)


def vae_decode(vae: V.AutoencoderKLFlux2):
    """`fn(z)`: the VAE's decode of normalised latents [1, h, w, 128], waited for."""
    graphdef, state = nnx.split(vae)
    decode = jax.jit(lambda state, z: V.decode_latents(nnx.merge(graphdef, state), z))
    return lambda z: decode(state, z).block_until_ready()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--vae", action="store_true", help="time the FLUX.2 VAE's decoder too")
    args = parser.parse_args()
    previewer = Previewer(TAEF2Decoder(rngs=nnx.Rngs(0)))
    vae = vae_decode(V.AutoencoderKLFlux2(V.VAEConfig.flux2(), rngs=nnx.Rngs(0))) if args.vae else None
    print(f"{jax.devices()[0].device_kind}, {args.rounds} rounds")
    print(
        "| output | TAEF2 frame ms (best / median) | first frame s |"
        + (" VAE decode ms (best) |" if vae else "")
    )
    print("|---|---|---|" + ("---|" if vae else ""))
    for size in args.sizes:
        grid = (size // 16, size // 16)
        latents = np.random.default_rng(0).standard_normal((1, grid[0] * grid[1], 128)).astype(np.float32)
        first, best, median = timed(args.rounds, previewer.images, latents, grid)
        row = f"| {size}x{size} | {best * 1e3:.0f} / {median * 1e3:.0f} | {first:.1f} |"
        if vae:
            z = jnp.asarray(latents).reshape(1, *grid, 128)
            row += f" {timed(max(1, args.rounds // 2), vae, z)[1] * 1e3:.0f} |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
