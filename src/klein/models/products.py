"""Products with weights: accumulated in float32 and rounded once to the inputs' precision, as torch does.

XLA's GPU and TPU backends multiply bf16 matrices that way whatever they are asked, and are left as they
are. XLA:CPU, asked for a bf16 result, widens both operands to float32 first: a float32 copy of each
weight matrix as it runs it, about 1.4 of klein-9b's double blocks at once (1.5 GiB). Asked for a float32
result (`preferred_element_type`), a CPU with bf16 dot products (AVX512-BF16 or AMX) multiplies the bf16
operands as they are, with no copy, and faster (one 1024x4096 by 4096x12288 product: 0.78 s against
1.25 s, AMD EPYC with AVX512-BF16, two cores). On a CPU without them (AVX2) XLA widens the operands either
way, and asking for float32 was 1.27-1.45x slower there, so the product is left to XLA: whether a CPU
multiplies in place is asked of the compiler once (`in_place`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from klein import sharding

ROWS = 1024
"""Rows a CPU multiplies at once: the float32 result before its rounding stays ROWS x N."""


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
    """`jax.lax.dot_general` in the inputs' dtype (or `preferred_element_type`); takes `nnx.Linear`'s
    `dot_general` arguments. On a CPU that multiplies bf16 in place (`in_place`), accumulated in float32
    and rounded once, without a widened copy of the operands.

    XLA:CPU's product of a single row (a vector by a matrix: the modulations of one image) widens the
    matrix even so; two rows do not (0.05 s instead of 0.15 s for klein-9b's 4096 x 24576 modulation), so
    a single row is multiplied beside a row of zeros. Outside a mesh, more than `ROWS` rows by a matrix are
    multiplied `ROWS` at a time, each block rounded as it is made (`_in_blocks`)."""
    out = preferred_element_type or jnp.result_type(lhs, rhs)
    if out == jnp.float32 or not in_place(sharding.platform()):
        return jax.lax.dot_general(
            lhs, rhs, dimension_numbers, precision, preferred_element_type=preferred_element_type, **kwargs
        )

    def rounded(lhs):
        wide = jax.lax.dot_general(
            lhs, rhs, dimension_numbers, precision, preferred_element_type=jnp.float32, **kwargs
        )
        return wide.astype(out)

    (contracting, _), (batch, _) = dimension_numbers
    rows = math.prod(n for axis, n in enumerate(lhs.shape) if axis not in contracting)
    if rows == 1 and not batch and lhs.ndim > 1 and 0 not in contracting:
        return rounded(jnp.concatenate([lhs, jnp.zeros_like(lhs)]))[:1]
    by_matrix = dimension_numbers == (((lhs.ndim - 1,), (0,)), ((), ())) and rhs.ndim == 2
    if rows <= ROWS or not by_matrix or any(kwargs.values()) or not jax.sharding.get_abstract_mesh().empty:
        return rounded(lhs)
    product = _in_blocks(lhs.reshape(rows, lhs.shape[-1]), rhs, precision, out)
    return product.reshape(*lhs.shape[:-1], rhs.shape[-1])


def _in_blocks(x, w, precision, dtype):
    """x[R, K] @ w[K, N] in float32, `ROWS` rows at a time, each block rounded to `dtype` as it is made:
    the whole float32 result of a long sequence's fused projection (klein-9b, 16,384 reference tokens:
    2.3 GiB) would live beside its rounded copy. The blocks are faster too (4.7 s against 5.7 s for
    8,704 x 3,072 by 3,072 x 27,648, AMD EPYC). On a mesh the rows are split over devices, and slicing
    them would gather them: not there."""
    count = x.shape[0]

    def block(i, out):
        # The last block overlaps the one before: the same rows, the same values.
        start = jnp.minimum(i * ROWS, count - ROWS)
        rows = jax.lax.dynamic_slice_in_dim(x, start, ROWS)
        wide = jnp.dot(rows, w, precision=precision, preferred_element_type=jnp.float32)
        return jax.lax.dynamic_update_slice_in_dim(out, wide.astype(dtype), start, 0)

    return jax.lax.fori_loop(0, -(-count // ROWS), block, jnp.zeros((count, w.shape[1]), dtype))


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
