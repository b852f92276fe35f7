"""VAE decode time with and without klein's exact rewrites, interleaved in one process.

Variants: "plain" (nearest-neighbour 2x repeat then a 3x3 conv; Flax's two-pass GroupNorm), "groupnorm"
(klein's one-pass GroupNorm, upsample plain) and "klein" (both rewrites as `models/vae.py` ships them,
so "groupnorm" against "klein" isolates the sub-pixel upsample).
Each variant is compiled once per size, then the variants take turns for `--rounds` rounds; the
table gives the best time of each (a shared machine only ever adds time). Random weights: the time
does not depend on them.

    python benchmarks/vae/vae_decode.py --vae demo --sizes 512 1024 --rounds 7
"""

import argparse
import contextlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from klein.models import vae as V

VAES = {
    "demo": V.VAEConfig(block_out_channels=(16, 16, 32, 32), layers_per_block=1, norm_num_groups=8),
    "bench-cpu": V.VAEConfig(block_out_channels=(16, 32, 64, 64), norm_num_groups=16),
}


def _plain_upsample(self, x):
    return self.conv(jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2))


@contextlib.contextmanager
def _variant(name: str):
    """Trace with the plain formulations put back where the variant asks for them."""
    saved = V.Upsample.__call__, V.GroupNorm.__call__
    if name in ("plain", "groupnorm"):
        V.Upsample.__call__ = _plain_upsample
    if name == "plain":
        V.GroupNorm.__call__ = nnx.GroupNorm.__call__  # use_fast_variance=False: two passes
    try:
        yield
    finally:
        V.Upsample.__call__, V.GroupNorm.__call__ = saved


def compiled(vae, z, name: str):
    graphdef, state = nnx.split(vae)
    with _variant(name):
        fn = jax.jit(lambda state, z: nnx.merge(graphdef, state).decode(z)).lower(state, z).compile()
    return lambda: fn(state, z)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vae", choices=tuple(VAES), default="demo")
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    vae = V.AutoencoderKLFlux2(VAES[args.vae], rngs=nnx.Rngs(0))
    names = ("plain", "groupnorm", "klein")
    print(
        f"| {args.vae} VAE decode | "
        + " | ".join(f"{n} s" for n in names)
        + " | groupnorm / klein | plain / klein |"
    )
    print("|---|" + "---|" * (len(names) + 2))
    for size in args.sizes:
        z = jnp.asarray(np.random.default_rng(0).standard_normal((1, size // 8, size // 8, 32)), jnp.float32)
        runs = {name: compiled(vae, z, name) for name in names}
        outputs = {name: np.asarray(run()) for name, run in runs.items()}
        drift = max(float(np.abs(out - outputs["plain"]).max()) for out in outputs.values())
        best = dict.fromkeys(names, float("inf"))
        for round_ in range(args.rounds):
            for name in names if round_ % 2 == 0 else names[::-1]:
                start = time.perf_counter()
                runs[name]().block_until_ready()
                best[name] = min(best[name], time.perf_counter() - start)
        cells = " | ".join(f"{best[n]:.3f}" for n in names)
        ratios = f"{best['groupnorm'] / best['klein']:.2f}x | {best['plain'] / best['klein']:.2f}x"
        print(f"| {size}^2 (max abs diff {drift:.1e}) | {cells} | {ratios} |")


if __name__ == "__main__":
    main()
