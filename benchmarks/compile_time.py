"""Compile time and run time of one transformer forward: layers scanned vs fully unrolled.

Compile time depends on depth and graph structure, hardly on width, so the real 9b layer count is
measured at a CPU-friendly width. Random weights; no checkpoint needed.

    python benchmarks/compile_time.py --layers 8 24 --heads 2 --tokens 1024 --text 512
"""

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from klein.models import transformer as T
from klein.models.rope import rope_tables
from klein.models.transformer_config import KLEIN_9B


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


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, nargs=2, default=(8, 24), help="double and single blocks")
    parser.add_argument("--heads", type=int, default=2, help="heads of 128 channels")
    parser.add_argument("--tokens", type=int, default=1024, help="image tokens (a square number)")
    parser.add_argument("--text", type=int, default=512, help="text tokens")
    args = parser.parse_args()
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
