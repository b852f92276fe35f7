"""Temporaries of the KV reference prefill over 4 references of 1024 px (16,384 tokens): XLA's
`compiled.memory_analysis()` on one device and per device on `context=2`, at the demo model's width and
at klein-9b's (one double and one single block: activations do not grow with depth), next to
`klein plan`'s prefill estimate. Compiles only, allocates nothing.
Run: python benchmarks/memory/attention_memory.py   (simulates 2 CPU devices for the mesh)

Before the tiled attention (dense on a mesh, query blocks of 256 x all keys on one device), the same
script printed, in MiB: demo 48 single / 2,054 context=2; 9b shapes 3,844 single / 33,026 context=2.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import dataclasses  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from klein import sharding  # noqa: E402
from klein.io.demo import TRANSFORMER  # noqa: E402
from klein.memory import activations
from klein.models import transformer as T  # noqa: E402
from klein.models.transformer_config import KLEIN_9B, TransformerConfig  # noqa: E402

TOKENS = 4 * 64 * 64
SHALLOW_9B = dataclasses.replace(KLEIN_9B, num_layers=1, num_single_layers=1)


def temporaries(cfg, mesh) -> int:
    """Temporary bytes per device of the jitted prefill, weights and inputs as shapes only."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: T.Flux2Transformer(cfg, rngs=nnx.Rngs(0))))
    ref = jax.ShapeDtypeStruct((TOKENS, cfg.in_channels), jnp.float32)
    rope = (jax.ShapeDtypeStruct((TOKENS, cfg.attention_head_dim), jnp.float32),) * 2
    with sharding.use(mesh):
        fn = jax.jit(lambda s, r, p: T.prefill(nnx.merge(graphdef, s), r, p))
        return fn.lower(state, ref, rope).compile().memory_analysis().temp_size_in_bytes


def estimate(cfg, spec: str) -> int:
    return activations.activations(cfg, sharding.abstract_mesh(spec), 1, TOKENS, TOKENS, 4)


def main() -> None:
    print("| model | mesh | XLA temporaries MiB per device | plan estimate MiB |")
    print("|---|---|---|---|")
    for name, cfg in (("demo", TransformerConfig.from_diffusers(TRANSFORMER)), ("9b shapes", SHALLOW_9B)):
        for spec, mesh in (("single", None), ("context=2", sharding.make_mesh("context=2"))):
            got = temporaries(cfg, mesh)
            print(f"| {name} | {spec} | {got / 2**20:,.0f} | {estimate(cfg, spec) / 2**20:,.0f} |")


if __name__ == "__main__":
    main()
