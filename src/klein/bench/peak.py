"""The machine's dense matrix-product peak for the benchmark's dtype, measured in the benchmark's process
by each engine's own library (here XLA's, jitted, float32 accumulation); the report takes the best of any.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from klein import dtypes


@jax.jit
def _product(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def matmul_flops_per_second(dtype: str, size: int, repeats: int = 5) -> float:
    """Best FLOP/s of `repeats` timed products of two size x size matrices (after one warm-up)."""
    rng = np.random.default_rng(size)
    a, b = (jnp.asarray(rng.standard_normal((size, size)), dtypes.dtype(dtype)) for _ in range(2))
    return best_rate(lambda: _product(a, b).block_until_ready(), 2.0 * size**3, repeats)


def best_rate(run, flops: float, repeats: int) -> float:
    """`flops` over the fastest of `repeats` timed calls of `run` (which waits for its work), after one
    untimed call."""
    return flops / best_seconds(run, repeats)


def best_seconds(run, repeats: int) -> float:
    """The fastest of `repeats` timed calls of `run` (which waits for its work), after one untimed call."""
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best
