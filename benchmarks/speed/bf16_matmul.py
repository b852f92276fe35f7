"""A bf16 product through XLA (jitted, float32 accumulation, as `klein.bench.peak` measures it) and through
torch (`torch.mm`, as diffusers multiplies), beside the same product in float32: what each engine's bf16
route gets from this CPU. Best of `--repeats` timed products after one warm-up, printed as each is done.

    PYTHONPATH=src:. python benchmarks/speed/bf16_matmul.py --shape 2048 3072 3072
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import torch

from klein.bench.peak import best_rate


@jax.jit
def _product(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def routes(a: np.ndarray, b: np.ndarray, dtype: str) -> dict:
    """Each engine's product of `a` by `b` in `dtype`, as a call that waits for it."""
    xa, xb = jnp.asarray(a, dtype), jnp.asarray(b, dtype)
    ta, tb = (torch.from_numpy(v).to(getattr(torch, dtype)) for v in (a, b))
    return {"xla": lambda: _product(xa, xb).block_until_ready(), "torch": lambda: torch.mm(ta, tb)}


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", type=int, nargs=3, default=(2048, 3072, 3072), metavar=("M", "K", "N"))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtypes", nargs="+", default=("bfloat16", "float32"))
    args = parser.parse_args()
    m, k, n = args.shape
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    print(
        f"{m} x {k} by {k} x {n}; jax {jax.__version__}, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads)"
    )
    for dtype in args.dtypes:
        for name, run in routes(a, b, dtype).items():
            rate = best_rate(run, 2.0 * m * k * n, args.repeats)
            print(f"{name:5s} {dtype:8s} {rate / 1e9:7.1f} GFLOP/s", flush=True)


if __name__ == "__main__":
    main()
