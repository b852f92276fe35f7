"""FLUX.2-small-decoder against the full FLUX.2 decoder: decode time and memory at the real widths.

Both decoders ([128, 256, 512, 512] and the small one's [96, 192, 384, 384]) with random weights in the
pipeline's dtype (bf16 unless --dtype), each compiled once per size; then they take turns for `--rounds`
rounds and the table gives the best time of each (a shared machine only ever adds time). Memory is XLA's
own plan of each compiled decode (`memory_analysis()`: weights in, temporaries, the image out), beside the
planner's estimate of the decode's activations (`klein plan`'s "decode" row) and the decoder's FLOPs.

    python benchmarks/vae/small_decoder.py --sizes 1024 --rounds 3
"""

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from klein import dtypes
from klein.bench.flops import decode_flops
from klein.bench.runner import cpu_model
from klein.memory import activations
from klein.models import vae as V

FULL = V.VAEConfig.flux2()
DECODERS = {"full": FULL, "small": dataclasses.replace(FULL, decoder_block_out_channels=(96, 192, 384, 384))}
MiB = 2**20


def decoder(cfg: V.VAEConfig, dtype) -> tuple[nnx.Module, int]:
    """(the VAE's decoder with its post-quant conv, in `dtype`, and its parameter count)."""
    vae = V.AutoencoderKLFlux2(cfg, rngs=nnx.Rngs(0), param_dtype=dtype)
    parts = nnx.List([vae.post_quant_conv, vae.decoder])
    count = sum(p.size for p in jax.tree.leaves(nnx.state(parts, nnx.Param)))
    return parts, count


def compiled(parts: nnx.Module, z: jax.Array):
    """(run, XLA's memory analysis) of the decode of `z`."""
    graphdef, state = nnx.split(parts)

    def decode(state, z):
        post_quant_conv, dec = nnx.merge(graphdef, state)
        return dec(post_quant_conv(z))

    fn = jax.jit(decode).lower(state, z).compile()
    return (lambda: fn(state, z)), fn.memory_analysis()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = parser.parse_args()
    dtype = dtypes.dtype(args.dtype)
    models = {name: decoder(cfg, dtype) for name, cfg in DECODERS.items()}
    print(f"{cpu_model()}; {jax.device_count()} device(s); {args.dtype}; best of {args.rounds} rounds\n")
    print("| decoder, side px | params | GFLOP | s | weights MiB | temporaries MiB | output MiB | plan MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for size in args.sizes:
        z = np.random.default_rng(0).standard_normal((1, size // 8, size // 8, 32))
        z = jnp.asarray(z, dtype)
        runs = {name: compiled(parts, z) for name, (parts, _) in models.items()}
        best = dict.fromkeys(runs, float("inf"))
        for round_ in range(args.rounds):
            for name in runs if round_ % 2 == 0 else reversed(runs):
                start = time.perf_counter()
                runs[name][0]().block_until_ready()
                best[name] = min(best[name], time.perf_counter() - start)
        for name, (_, analysis) in runs.items():
            cfg, count = DECODERS[name], models[name][1]
            planned = activations.decode_activations(cfg, 1, size, size, tiled=False)
            print(
                f"| {name}, {size} | {count / 1e6:.1f} M | {decode_flops(cfg, 1, size, size) / 1e9:.0f} "
                f"| {best[name]:.2f} | {analysis.argument_size_in_bytes / MiB:.0f} "
                f"| {analysis.temp_size_in_bytes / MiB:.0f} | {analysis.output_size_in_bytes / MiB:.0f} "
                f"| {planned / MiB:.0f} |"
            )


if __name__ == "__main__":
    main()
