"""The machine's dense matrix-product peak for the benchmark's dtype, measured in the benchmark's process.

Square products C[n, n] = A[n, n] @ B[n, n] (2 n^3 FLOPs) at a few sizes, each timed several times
after a warm-up, by each engine's own library: here XLA's (jitted, float32 accumulation: what XLA does
for float32, and the fast path for bfloat16); `klein.bench.engines` times torch's the same way. The
peak is the best FLOP/s of any of them: on a shared machine other processes only ever slow a product
down, and the faster library is the closer to what the machine can do.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from klein import dtypes


def _product(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


_jitted = jax.jit(_product)


def matmul_flops_per_second(dtype: str, size: int, repeats: int) -> float:
    """Best FLOP/s of `repeats` timed products of two size x size matrices (after one warm-up)."""
    rng = np.random.default_rng(size)
    a, b = (jnp.asarray(rng.standard_normal((size, size)), dtypes.dtype(dtype)) for _ in range(2))
    return best_rate(lambda: _jitted(a, b).block_until_ready(), 2.0 * size**3, repeats)


def best_rate(run, flops: float, repeats: int) -> float:
    """`flops` over the fastest of `repeats` timed calls of `run` (which waits for its work), after one
    untimed call."""
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return flops / best


def matmul_peak(dtype: str, sizes: tuple[int, ...], repeats: int = 5) -> dict[int, float]:
    """FLOP/s per size (best of `repeats`); the peak is the largest value."""
    return {size: matmul_flops_per_second(dtype, size, repeats) for size in sizes}
