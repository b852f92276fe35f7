"""Attention compiled for a TPU slice from this machine (libtpu, no TPU): XLA's temporaries per device of one
klein-9b attention (32 heads of 128, bf16, keys with padding ranks) split over `tensor`, for each kernel
the seam could take there: Pallas splash (what a TPU program gets), klein's blocked XLA kernel and XLA's
dense `jax.nn.dot_product_attention`. Compiles only, allocates nothing.

    pip install -e ".[tpu]" && python benchmarks/tpu/tpu_attention_memory.py [--target v6e:2x4]
"""

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from klein.aot import topology  # noqa: E402
from klein.models import attention as A  # noqa: E402
from klein.sharding import use  # noqa: E402


def dense(q, k, v, q_rank, k_rank):
    mask = (k_rank[:, None, None, :] <= q_rank[:, None, :, None]).astype(bool)
    return jax.nn.dot_product_attention(q, k, v, mask=mask)


def blocked(q, k, v, q_rank, k_rank):
    """The seam as on any other platform: klein's blocked kernel in the same `shard_map`."""
    A.SPLASH_PLATFORMS = ()
    try:
        return A.attention(q, k, v, q_rank, k_rank)
    finally:
        A.SPLASH_PLATFORMS = ("tpu",)


def temporaries(mesh, fn, tokens: int) -> int:
    qkv = jax.ShapeDtypeStruct(
        (1, tokens, 32, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, None, "tensor"))
    )
    ranks = jax.ShapeDtypeStruct((1, tokens), jnp.int32, sharding=NamedSharding(mesh, P()))
    with use(mesh):
        return jax.jit(fn).lower(qkv, qkv, qkv, ranks, ranks).compile().memory_analysis().temp_size_in_bytes


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default="v6e:2x4")
    parser.add_argument("--tokens", type=int, nargs="+", default=[4608, 8192, 16384])
    flags = parser.parse_args()
    mesh, spec = topology.mesh(flags.target, None)
    kernels = {
        "splash": A.attention,
        "blocked XLA": blocked,
        "dense XLA": dense,
    }
    print(f"{flags.target}, mesh {spec}: temporaries per device, MiB")
    print(f"{'tokens':>8}" + "".join(f"{name:>14}" for name in kernels))
    for tokens in flags.tokens:
        row = [temporaries(mesh, fn, tokens) / 2**20 for fn in kernels.values()]
        print(f"{tokens:>8}" + "".join(f"{value:>14.1f}" for value in row))


if __name__ == "__main__":
    main()
