"""How a stored weight becomes a product: `product(x, weight, dtype)`, the one seam between a Linear's
stored form (a `Weight`: plain, 8-bit with its scales, or a file's quantisation blocks) and the model's
math. See docs/design/checkpoints.md, "How a stored layer becomes a product", and docs/design/memory.md
for the float32 products on a CPU (`in_place`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np

from klein import sharding
from klein.models import block_scaled, gguf_blocks, mxfp8, nvfp4, stacks

BF16, FP8, INT8 = "bf16", "fp8", "int8"
# 8-bit compute -> (operand dtype, largest value quantised to, accumulator dtype)
EIGHT_BIT = {FP8: (jnp.float8_e4m3fn, 448.0, jnp.float32), INT8: (jnp.int8, 127.0, jnp.int32)}
NVFP4, MXFP8 = block_scaled.NVFP4, block_scaled.MXFP8
BLOCK_SCALED = (NVFP4, MXFP8)
"""Computes whose products take both operands in blocks of the format of that name (`block_scaled`)."""
# Block formats a kernel may be stored in ([out, in / values * bytes] uint8, widened inside the product
# unless its compute is block-scaled): GGUF's ggml types, NVFP4 (whose per-tensor scale is the Linear's
# `weight_scale`) and MXFP8.
BLOCKS = (*gguf_blocks.TYPES, *BLOCK_SCALED)
MIXED = tuple  # `blocks` of a stack of several ggml types: those types, each layer's row tagged with one


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=("array", "scale", "input_scale"),
    meta_fields=("compute", "out_in", "blocks"),
)
@dataclasses.dataclass(frozen=True)
class Weight:
    """A Linear's stored weight and how it is multiplied (`compute`: bf16, fp8, int8 or, for a kernel of
    that block format, nvfp4 or mxfp8), as `product`
    reads it: `array` [in, out], or [out, in] if `out_in` (rows of blocks when `blocks` names their
    format); `scale` None, float32[] or float32[out] on the output columns; `input_scale` float32[], an
    FP8 file's activation scale. A pytree whose layout is static, so a jitted function may take one."""

    array: jax.Array
    scale: jax.Array | None = None
    input_scale: jax.Array | None = None
    compute: str = BF16
    out_in: bool = False
    blocks: str | tuple[str, ...] | None = None

    def outputs(self, columns: slice) -> Weight:
        """The weight of output columns `columns` only (a per-channel scale sliced with them)."""
        if columns == slice(None):
            return self
        array = self.array[..., columns, :] if self.out_in else self.array[..., columns]
        scale = self.scale[..., columns] if self.scale is not None and self.scale.ndim else self.scale
        return dataclasses.replace(self, array=array, scale=scale)


def product(x, weight: Weight, dtype, low_rank=None, gain=None):
    """`x @ (kernel * scale)` float[..., out] in `dtype` for x float[..., in] and the stored `weight`;
    `low_rank` float32[..., out]: unmerged adapters' term (`klein.models.adapters.term`), added in float32
    before the one rounding, and `gain` (with it) float32 broadcast to [..., out]: DoRA's scale on the base
    product. A kernel of quantisation blocks is widened to float32 here, so only the layer
    being run exists wide, unless its compute is block-scaled (`BLOCK_SCALED`): then `x` is quantised
    in blocks too and the blocks are multiplied as stored (`block_scaled.product`)."""
    kernel, scale, compute, out_in = weight.array, weight.scale, weight.compute, weight.out_in
    if compute in BLOCK_SCALED and jnp.dtype(kernel.dtype).itemsize == 1:
        total = block_scaled.product(x, kernel, scale, compute, sharding.platform() in ("gpu", "cuda"))
        extra = 0 if low_rank is None else low_rank
        return (total * (1 if gain is None else gain) + extra).astype(dtype)
    # A block format's kernel is its bytes, unless a merged LoRA widened it already.
    if weight.blocks is not None and jnp.dtype(kernel.dtype).itemsize == 1:
        kernel = unpacked(kernel, weight.blocks, dtype)
    dims = (((x.ndim - 1,), (1 if out_in else 0,)), ((), ()))
    extra = 0 if low_rank is None else low_rank
    if compute not in EIGHT_BIT:
        if scale is None and low_rank is None:
            return dot_general(x.astype(dtype), kernel.astype(dtype), dims)
        total = dot_general(x.astype(dtype), kernel.astype(dtype), dims, preferred_element_type=jnp.float32)
        return (total * (1 if scale is None else scale) * (1 if gain is None else gain) + extra).astype(dtype)
    _, _, accumulator = EIGHT_BIT[compute]
    if weight.input_scale is None:
        values, tokens = quantise(x, compute, -1)
    else:
        values, tokens = in_8_bits(x, weight.input_scale, compute), weight.input_scale
    total = jax.lax.dot_general(values, kernel, dims, preferred_element_type=accumulator)
    return (total.astype(jnp.float32) * tokens * scale * (1 if gain is None else gain) + extra).astype(dtype)


def dense(weight: Weight) -> jax.Array:
    """float32[out, in] of one layer's stored `weight` (no layer axis; a stack's layer may be its bits) as
    `product` multiplies it: widened from its blocks, times its scale."""
    array = weight.array
    if weight.blocks is not None and jnp.dtype(array.dtype).itemsize == 1:
        wide = unpacked(stacks.view(array, jnp.uint8), weight.blocks)
    else:
        wide = stacks.as_float(array).astype(jnp.float32)
    wide = wide if weight.out_in else wide.T
    if weight.scale is None:
        return wide
    return wide * (weight.scale[:, None] if weight.scale.ndim else weight.scale)


def unpacked(raw, blocks: str | tuple[str, ...], dtype=jnp.float32):
    """float32[..., out, in] of rows of quantisation blocks `raw` [..., out, bytes] of format `blocks` (a
    tuple: a mixed stack's types, each layer's rows tagged with the index of its own, `MIXED`), rounded
    to `dtype`."""
    if isinstance(blocks, MIXED):
        return _switched(raw, blocks, dtype)
    own = {NVFP4: nvfp4.dequantise, MXFP8: mxfp8.dequantise}.get(blocks)
    wide = own(raw) if own else gguf_blocks.dequantise(raw, blocks)
    return wide.astype(dtype)


def _switched(raw, kinds: tuple[str, ...], dtype):
    """A mixed stack's layer (or layers) widened by its own type: `jax.lax.switch` on the index its first
    row ends in, over branches that all give the same float32[out, in] (XLA compiles each, runs one).
    Each branch rounds to `dtype` itself: a switch's result is written out whole, and XLA:CPU widened a
    layer to bf16 2.6x slower when its float32 values were written out first."""
    if raw.ndim > 2:  # whole stacks (a LoRA merge's restore): a layer at a time
        return jax.lax.map(lambda layer: _switched(layer, kinds, dtype), raw)
    raw = stacks.view(raw, jnp.uint8)  # a stack slices its layers as float8
    columns = unpacked_width(kinds, raw.shape[-1])
    branches = [
        functools.partial(
            lambda rows, kind: unpacked(rows[:, : packed_width(kind, columns)], kind, dtype), kind=kind
        )
        for kind in kinds
    ]
    return jax.lax.switch(raw[0, -1].astype(jnp.int32), branches, raw)


def packed_width(blocks: str | tuple[str, ...], columns: int) -> int:
    """Bytes of a row of `columns` values in block format `blocks` (a mixed stack's: its widest type's and
    the byte naming the layer's type)."""
    if isinstance(blocks, MIXED):
        return max(packed_width(kind, columns) for kind in blocks) + 1
    values, size = _sizes(blocks)
    return columns // values * size


def unpacked_width(blocks: str | tuple[str, ...], width: int) -> int:
    """Values in a row of `width` bytes in block format `blocks`."""
    if isinstance(blocks, MIXED):
        return unpacked_width(max(blocks, key=lambda kind: Fraction(*_sizes(kind)[::-1])), width - 1)
    values, size = _sizes(blocks)
    return width // size * values


def _sizes(blocks: str) -> tuple[int, int]:
    """(values, bytes) of one block of format `blocks`."""
    own = {NVFP4: (nvfp4.BLOCK, nvfp4.BLOCK_BYTES), MXFP8: (mxfp8.BLOCK, mxfp8.BLOCK_BYTES)}
    return own[blocks] if blocks in own else gguf_blocks.sizes(blocks)


def quantise(values, compute: str, axis: int):
    """(8-bit values, float32 scales) of `values` (NumPy or JAX), symmetric, one scale per slice across
    `axis` (kept as an axis of 1): `values ~ 8-bit * scales`, the largest magnitude of a slice mapped to
    the format's largest value (`scales_of`, `in_8_bits`)."""
    scales = scales_of(values, compute, axis)
    return in_8_bits(values, scales, compute), scales


def in_8_bits(values, scales, compute: str):
    """`values` times the reciprocal of `scales` (not divided by them: XLA makes a division by a broadcast
    scale that product anyway), clipped to the format's range, int8 rounded half to even, float8 e4m3
    to nearest even."""
    xp = np if isinstance(values, np.ndarray) else jnp
    operand, top, _ = EIGHT_BIT[compute]
    scaled = xp.clip(values.astype(np.float32) * (np.float32(1) / scales), -top, top)
    return (xp.round(scaled) if compute == INT8 else scaled).astype(operand)


def scales_of(values, compute: str, axis: int):
    """The float32 scales `quantise` divides `values` by: the largest magnitude of each slice across `axis`
    times the float32 reciprocal of the format's largest value (1 for a slice of zeros). A product with a
    constant, not a quotient: XLA makes a division by a constant that product, NumPy does not."""
    xp = np if isinstance(values, np.ndarray) else jnp
    reciprocal = np.float32(1 / EIGHT_BIT[compute][1])
    largest = xp.max(xp.abs(values.astype(np.float32)), axis=axis, keepdims=True)
    return xp.where(largest > 0, largest * reciprocal, np.float32(1)).astype(np.float32)


def dot_general(lhs, rhs, dimension_numbers, preferred_element_type=None):
    """`jax.lax.dot_general` in the inputs' dtype (or `preferred_element_type`), accumulated in float32
    without a widened copy of the operands where the backend can (`in_place`).

    XLA:CPU's product of a single row (a vector by a matrix: the modulations of one image) widens the
    matrix even so; two rows do not (0.05 s instead of 0.15 s for klein-9b's 4096 x 24576 modulation), so
    a single row is multiplied beside a row of zeros."""
    out = preferred_element_type or jnp.result_type(lhs, rhs)
    if out == jnp.float32 or not in_place(sharding.platform()):
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, preferred_element_type=preferred_element_type)
    (contracting, _), (batch, _) = dimension_numbers
    rows = math.prod(n for axis, n in enumerate(lhs.shape) if axis not in contracting)
    single = rows == 1 and not batch and lhs.ndim > 1 and 0 not in contracting
    if single:
        lhs = jnp.concatenate([lhs, jnp.zeros_like(lhs)])
    product = jax.lax.dot_general(lhs, rhs, dimension_numbers, preferred_element_type=jnp.float32)
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
