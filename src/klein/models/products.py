"""Products with weights: accumulated in float32 and rounded once to the inputs' precision, as torch does.

XLA's GPU and TPU backends multiply bf16 matrices that way whatever they are asked, and are left as they
are. XLA:CPU, asked for a bf16 result, widens both operands to float32 first: a float32 copy of each
weight matrix as it runs it, about 1.4 of klein-9b's double blocks at once (1.5 GiB). Asked for a float32
result (`preferred_element_type`), a CPU with bf16 dot products (AVX512-BF16 or AMX) multiplies the bf16
operands as they are, with no copy, and faster (one 1024x4096 by 4096x12288 product: 0.78 s against
1.25 s, AMD EPYC with AVX512-BF16, two cores). On a CPU without them (AVX2) XLA widens the operands either
way, and asking for float32 was 1.27-1.45x slower there, so the product is left to XLA: whether a CPU
multiplies in place is asked of the compiler once (`in_place`). The price on a CPU: the float32 product
before its rounding (for a long sequence, the fused projection of a single block).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from klein import sharding


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
    """`jax.lax.dot_general` in the inputs' dtype (or `preferred_element_type`), accumulated in float32
    without a widened copy of the operands where the backend can (`in_place`); takes `nnx.Linear`'s
    `dot_general` arguments.

    XLA:CPU's product of a single row (a vector by a matrix: the modulations of one image) widens the
    matrix even so; two rows do not (0.05 s instead of 0.15 s for klein-9b's 4096 x 24576 modulation), so
    a single row is multiplied beside a row of zeros."""
    out = preferred_element_type or jnp.result_type(lhs, rhs)
    if out == jnp.float32 or not in_place(sharding.platform()):
        return jax.lax.dot_general(
            lhs, rhs, dimension_numbers, precision, preferred_element_type=preferred_element_type, **kwargs
        )
    (contracting, _), (batch, _) = dimension_numbers
    rows = math.prod(n for axis, n in enumerate(lhs.shape) if axis not in contracting)
    single = rows == 1 and not batch and lhs.ndim > 1 and 0 not in contracting
    if single:
        lhs = jnp.concatenate([lhs, jnp.zeros_like(lhs)])
    product = jax.lax.dot_general(
        lhs, rhs, dimension_numbers, precision, preferred_element_type=jnp.float32, **kwargs
    )
    return (product[:1] if single else product).astype(out)


@functools.cache
def in_place(platform: str) -> bool:
    """Whether to ask `platform` for float32 products: a CPU that multiplies bf16 matrices into float32
    without a float32 copy of them (a small product compiled there holds fewer temporary bytes than its
    widened weight). Accelerators accumulate bf16 products in float32 whatever they are asked: their
    programs are left as XLA makes them."""
    if platform != "cpu":
        return False
    device = jax.sharding.SingleDeviceSharding(jax.devices(platform)[0])
    lhs = jax.ShapeDtypeStruct((8, 256), jnp.bfloat16, sharding=device)
    rhs = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=device)

    def product(a, b):
        return jnp.dot(a, b, preferred_element_type=jnp.float32)

    analysis = jax.jit(product).lower(lhs, rhs).compile().memory_analysis()
    return analysis is not None and analysis.temp_size_in_bytes < 256 * 512 * 4
