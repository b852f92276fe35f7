"""One-device attention speed: the jitted `klein.models.attention.attention` (no mask, float32) at the
token counts of text-to-image (1.5k), KV editing's cached steps (5.6k) and long prefills (16k), for a
grid of query-block and key-block sizes. Prints ms per call, GFLOP/s (4 S^2 H Dh) and the fraction of
this process's measured float32 matmul peak (`klein.bench.peak`).

Every variant is compiled first; then the timed rounds run each once in turn, and each figure is the
best of the rounds: timed back to back instead, variants on this shared 2-core VM differed by up to 2x
from one minute to the next.

Run: python benchmarks/speed/attention_speed.py [--tokens 1536 5632 16384] [--heads 2]
     [--query-blocks 128 256 512] [--key-blocks 1024 2048 4096 8192] [--rounds 5]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from klein.bench.peak import matmul_flops_per_second
from klein.bench.runner import cpu_model
from klein.models import attention as A

HEAD_DIM = 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1536, 5632, 16384])
    parser.add_argument("--heads", type=int, default=2, help="heads of 128 channels (bench-cpu: 2)")
    parser.add_argument("--query-blocks", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--key-blocks", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    inputs, variants = {}, {}
    for tokens in args.tokens:
        shape = (1, tokens, args.heads, HEAD_DIM)
        inputs[tokens] = tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in "qkv")
        for query_block in args.query_blocks:
            for key_block in args.key_blocks:
                if key_block < 2 * tokens:
                    A.QUERY_BLOCK, A.KEY_BLOCK = query_block, key_block  # read when traced
                    fn = jax.jit(A.attention).lower(*inputs[tokens]).compile()
                    variants[tokens, query_block, key_block] = fn
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(args.rounds):
        for key, fn in variants.items():
            start = time.perf_counter()
            fn(*inputs[key[0]]).block_until_ready()
            best[key] = min(best[key], time.perf_counter() - start)
    peak = max(matmul_flops_per_second("float32", n, args.rounds) for n in (1024, 2048))

    print(f"float32 matmul peak {peak / 1e9:.0f} GFLOP/s; {cpu_model()}; {jax.device_count()} device(s)\n")
    print("| tokens | query block | key block | ms | GFLOP/s | of peak |")
    print("|---|---|---|---|---|---|")
    for (tokens, query_block, key_block), seconds in best.items():
        rate = 4.0 * tokens * tokens * args.heads * HEAD_DIM / seconds
        print(
            f"| {tokens} | {query_block} | {key_block} | {seconds * 1e3:.1f} | {rate / 1e9:.0f} | {rate / peak:.0%} |"
        )


if __name__ == "__main__":
    main()
