"""One-device attention speed: the jitted `klein.models.attention.attention` on text-to-image shapes
(no mask), at 1.5k and 5.6k tokens, 8 heads of 128 channels, float32. Prints ms per call (median of 5).
Run: python benchmarks/attention_speed.py
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from klein.models.attention import attention

HEADS, HEAD_DIM = 8, 128


def median_ms(fn, *args, repeats: int = 5) -> float:
    fn(*args).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def main() -> None:
    rng = np.random.default_rng(0)
    fn = jax.jit(attention)
    print("| tokens | ms per call |")
    print("|---|---|")
    for tokens in (1536, 5632):
        q, k, v = (jnp.asarray(rng.standard_normal((1, tokens, HEADS, HEAD_DIM)), jnp.float32) for _ in "qkv")
        print(f"| {tokens} | {median_ms(fn, q, k, v):.0f} |")
    print(f"\n{jax.devices()[0].device_kind}, {jax.device_count()} device(s)")


if __name__ == "__main__":
    main()
