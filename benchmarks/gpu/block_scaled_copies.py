"""Bytes a block-scaled step writes to hand its weights to cuDNN's block-scaled GEMM, compiled for a B200
on this machine (jax's CUDA plugin; nothing runs): klein-9b-kv's cached step (1024^2, 2 references) with
`compute="nvfp4"` and `"mxfp8"`, then one [2048, 4096] x [4096 -> 4096] product with its weight in each
of four arrangements, to show where the copies come from.

Counted per run (`tests.support.hlo.block_scaled_weight_copies`): the arrays written from a stored
weight before each GEMM's call (values, block scales: copied, sliced or deinterleaved, in u8, float8 or
E2M1), and XLA's own swizzle of the weight's scales to cuDNN's tiled layout inside the call (cuDNN's
layout is not one JAX can hand it: XLA's block-scaling rewrite always transposes the scales it is given).

    PYTHONPATH=. JAX_PLATFORMS=cpu .venv-gpu-plan/bin/python benchmarks/gpu/block_scaled_copies.py  # gpu-plan extra

Measured (jax 0.10.2, its CUDA plugin; 2 shared cores, about 2 minutes), per step / per product:

    nvfp4: 5.078 GiB (values 4.062, scales 0.508, swizzle 0.508); arguments 9.25 GiB
    mxfp8: 8.633 GiB (values 8.125, scales 0.254, swizzle 0.254); arguments 13.06 GiB
    klein's rows of blocks, one weight: 10.000 MiB (values 8.000, scales 1.000, swizzle 1.000)
    values and scales apart, whole: 1.000 MiB (values 0.000, scales 0.000, swizzle 1.000)
    values and scales apart, scan: 10.000 MiB (values 8.000, scales 1.000, swizzle 1.000)
    values and scales apart, unrolled: 10.000 MiB (values 8.000, scales 1.000, swizzle 1.000)

Every block weight's values and scales are written out once a step, as stored (4.57 GiB NVFP4, 8.38
MXFP8), and its scales swizzled once more. Kept apart, a weight's values and scales reach the GEMM in
place only as whole arrays: a layer sliced out of a stack, inside `jax.lax.scan` or by a static index,
is copied for cuDNN's GEMM just the same (XLA reads a slice in place only for cuBLAS's GEMMs:
DynamicSliceFusion), and klein's blocks are all stacks. So storing values and scales apart would save
nothing in klein's steps while its layers are stacked.
"""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from klein.aot import topology
from klein.models import block_scaled
from klein.sharding import use
from tests.support.hlo import block_scaled_weight_copies
from tests.test_gpu_compile_8bit import compiled_9b_kv_steps
from tests.test_gpu_compile_block_scaled import compiled_product

GIB = 2**30
TOKENS, WIDTH, LAYERS = 2048, 4096, 4


def described(copies: dict[str, float], unit: float = GIB, name: str = "GiB") -> str:
    parts = ", ".join(f"{kind} {n / unit:.3f}" for kind, n in copies.items())
    return f"{sum(copies.values()) / unit:.3f} {name} ({parts})"


def separate(how: str) -> str:
    """Optimised HLO of `LAYERS` NVFP4 products with each weight's values uint8[out, in / 2] and E4M3
    scales uint8[out, in / 16] as arrays of their own: "whole" (one weight, its own arguments), "scan"
    (stacks [L, ...] run by `jax.lax.scan`, as klein runs its blocks) or "unrolled" (the same stacks,
    each layer a static slice)."""
    mesh, _ = topology.mesh("b200", None)
    whole = NamedSharding(mesh, P())
    layers = () if how == "whole" else (LAYERS,)
    x = jax.ShapeDtypeStruct((TOKENS, WIDTH), jnp.bfloat16, sharding=whole)
    values = jax.ShapeDtypeStruct((*layers, WIDTH, WIDTH // 2), jnp.uint8, sharding=whole)
    scales = jax.ShapeDtypeStruct((*layers, WIDTH, WIDTH // 16), jnp.uint8, sharding=whole)

    def one(h, v, s):
        elements, x_scales = block_scaled.quantise(h, "nvfp4", jnp.float32(1), paired=True)
        w = jax.lax.bitcast_convert_type(v, jnp.float4_e2m1fn).reshape(WIDTH, WIDTH)
        w_scales = jax.lax.bitcast_convert_type(s, jnp.float8_e4m3fn)
        total = jax.nn.scaled_matmul(elements[None], w[None], x_scales[None], w_scales[None])[0]
        return total.astype(jnp.bfloat16)

    def run(h, v, s):
        if how == "whole":
            return one(h, v, s)
        if how == "scan":
            body = lambda h, i: (one(h, v[i], s[i]), None)  # noqa: E731
            return jax.lax.scan(body, h, jnp.arange(LAYERS))[0]
        for i in range(LAYERS):
            h = one(h, v[i], s[i])
        return h

    with use(mesh):
        return jax.jit(run).lower(x, values, scales).compile().as_text()


def main():
    print("klein-9b-kv's cached step for one B200, 1024^2 with 2 references, per step:")
    for compute, (step, hlo) in compiled_9b_kv_steps("b200", ("nvfp4", "mxfp8")).items():
        print(
            f"  {compute}: {described(block_scaled_weight_copies(hlo))}; arguments {step.arguments / GIB:.2f} GiB"
        )
    mib = 2**20
    print(f"[{TOKENS}, {WIDTH}] x [{WIDTH} -> {WIDTH}] NVFP4 products, per product:")
    stored = block_scaled_weight_copies(compiled_product("b200", "nvfp4"))
    print(f"  klein's rows of blocks, one weight: {described(stored, mib, 'MiB')}")
    for how in ("whole", "scan", "unrolled"):
        copies = {
            k: n / (1 if how == "whole" else LAYERS)
            for k, n in block_scaled_weight_copies(separate(how)).items()
        }
        print(f"  values and scales apart, {how}: {described(copies, mib, 'MiB')}")


if __name__ == "__main__":
    main()
