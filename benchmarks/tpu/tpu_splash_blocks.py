"""Splash attention's tile sizes on a TPU: `klein.models.splash.attention` (bf16, no mask, head dim 128)
at the token counts the models attend over, for a grid of (query block, key block, keys per product).
Prints ms per attention, TFLOP/s (4 S^2 H Dh) and the fraction of the chip's bf16 spec peak; `--json` writes
every figure. `--chain` attentions run inside one program (a `fori_loop`, each one's output the next one's
queries), as a transformer runs them: a call of its own each (`--chain 1`) adds the host's dispatch and
synchronisation to a kernel of a few milliseconds (splash over 4,608 tokens read 93 TFLOP/s so and 125
chained). Each figure is the best of `--rounds` runs after a first that compiles.

Run (on a TPU host): python benchmarks/tpu/tpu_splash_blocks.py [--tokens 4608 8704 20480] [--heads 24]
     [--query-blocks 256 512 1024 2048] [--key-blocks 512 1024 2048] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import jax
import jax.numpy as jnp

from klein import devices
from klein.bench.peak import best_seconds
from klein.models import splash

HEAD_DIM = 128


def chained(q, k, v, blocks, count: int):
    """`count` attentions over the same keys, each one's output the next one's queries."""
    return jax.lax.fori_loop(0, count, lambda _, q: splash.attention(q, k, v, blocks=blocks), q)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4608, 8704, 20480])
    parser.add_argument("--heads", type=int, default=24, help="heads of 128 channels (klein-4b: 24, 9b: 32)")
    parser.add_argument("--query-blocks", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--key-blocks", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--chain", type=int, default=16, help="attentions chained in one program (default: %(default)s)"
    )
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    known = devices.of_kind(jax.devices()[0].device_kind)
    peak = known.bf16_flops / 1e12 if known else 0.0
    print(f"{jax.devices()[0].device_kind}, bf16 spec peak {peak} TFLOP/s")
    rows = []
    for tokens in args.tokens:
        keys = jax.random.split(jax.random.key(0), 3)
        q, k, v = (jax.random.normal(key, (1, tokens, args.heads, HEAD_DIM), jnp.bfloat16) for key in keys)
        flops = 4 * tokens**2 * args.heads * HEAD_DIM
        tiles = [(None, None, None)] + [
            (bq, bk, bc)
            for bq, bk, bc in itertools.product(args.query_blocks, args.key_blocks, args.key_blocks)
            if bc <= bk and bk % bc == 0 and bq <= tokens * 2 and bk <= tokens * 2
        ]
        for tile in tiles:
            blocks = None if tile[0] is None else tile
            run = jax.jit(functools.partial(chained, blocks=blocks, count=args.chain))
            try:
                call = functools.partial(run, q, k, v)
                seconds = (
                    best_seconds(lambda call=call: jax.block_until_ready(call()), args.rounds) / args.chain
                )
            except Exception as error:  # a tile VMEM cannot hold: say so and go on
                print(f"{tokens:>6} {tile}: {type(error).__name__}: {str(error).splitlines()[0][:120]}")
                continue
            tflops = flops / seconds / 1e12
            rows.append(
                dict(tokens=tokens, tile=tile, ms=round(seconds * 1e3, 3), tflop_per_s=round(tflops, 1))
            )
            share = f"{tflops / peak:.0%}" if peak else "-"
            print(
                f"{tokens:>6} {str(tile):>20} {seconds * 1e3:8.2f} ms {tflops:6.1f} TFLOP/s {share:>5}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            report = dict(device=jax.devices()[0].device_kind, heads=args.heads, chain=args.chain, rows=rows)
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
