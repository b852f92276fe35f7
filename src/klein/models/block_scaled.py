"""Block-scaled products (`compute="nvfp4" | "mxfp8"`): both operands of a block Linear's product
quantised per block of the contracted axis, as Blackwell's tensor cores multiply them, through
`jax.nn.scaled_matmul` (cuDNN's block-scaled GEMM) on an NVIDIA GPU and the same math in float32
elsewhere, so that it is tested on a CPU.

NVFP4: E2M1 values in blocks of 16, each with an E4M3 scale, and a float32 scale per tensor (the largest
magnitude over 6 x 448). MXFP8: E4M3 values in blocks of 32, each with an E8M0 (power-of-two) scale, the
block's largest magnitude over 448 rounded up to a power of two (as `jax.nn.scaled_dot_general` does,
so no value is clipped). A weight is quantised once at load and kept as rows of blocks
(`klein.models.nvfp4`, `klein.models.mxfp8`); activations are quantised in the product.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from klein.models import mxfp8, nvfp4, stacks

NVFP4, MXFP8 = "nvfp4", "mxfp8"


@dataclasses.dataclass(frozen=True)
class Format:
    block: int
    values: type
    scales: type
    top: float
    """The values' largest magnitude."""
    tensor_scale: bool
    """Whether a float32 scale per tensor sits above the block scales (NVFP4)."""


FORMATS = {
    NVFP4: Format(nvfp4.BLOCK, ml_dtypes.float4_e2m1fn, ml_dtypes.float8_e4m3fn, 6.0, True),
    MXFP8: Format(mxfp8.BLOCK, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e8m0fnu, 448.0, False),
}
E4M3_TOP = 448.0


def tensor_scale(values, compute: str):
    """float32[] the block scales of `values` (NumPy or JAX) are relative to: NVFP4's largest magnitude
    over 6 x 448 (1 for zeros), so the largest block scale is E4M3's largest; 1 for MXFP8."""
    xp = np if isinstance(values, np.ndarray) else jnp
    if not FORMATS[compute].tensor_scale:
        return xp.float32(1)
    largest = xp.max(xp.abs(values.astype(np.float32)))
    return xp.where(largest > 0, largest * np.float32(1 / (6.0 * E4M3_TOP)), np.float32(1)).astype(np.float32)


def quantise(values, compute: str, tensor=None, paired=False):
    """(values in the format's element type [..., K], block scales in its scale type [..., K / block]) of
    float `values` [..., K] (NumPy or JAX) over `tensor` (`tensor_scale`'s if None): `values ~ elements *
    block scales * tensor`, each rounded to nearest even; E2M1 ones in the order of a weight's
    (`weight_parts`: each pair swapped) if `paired`."""
    xp = np if isinstance(values, np.ndarray) else jnp
    form = FORMATS[compute]
    tensor = tensor_scale(values, compute) if tensor is None else tensor
    *lead, width = values.shape
    blocks = values.astype(np.float32).reshape(*lead, width // form.block, form.block) / tensor
    wanted = xp.max(xp.abs(blocks), axis=-1, keepdims=True) * np.float32(1 / form.top)
    if form.tensor_scale:
        scales = xp.clip(wanted, 0, E4M3_TOP).astype(form.scales)
    else:  # the power of two at or above: float32's exponent, one up where any mantissa bit is set
        bits = stacks.view(wanted, xp.uint32)
        exponent = (bits >> np.uint32(23)) + ((bits & np.uint32(0x7FFFFF)) > 0)
        scales = stacks.view(xp.maximum(exponent, 1).astype(xp.uint8), form.scales)
    wide = scales.astype(np.float32)
    elements = xp.clip(blocks / xp.where(wide > 0, wide, np.float32(1)), -form.top, form.top)
    elements = elements.reshape(*lead, width)
    return (e2m1(elements, paired) if form.tensor_scale else elements.astype(form.values)), scales[..., 0]


# Between E2M1's magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6: the midpoints, a tie going to the even code.
_MIDPOINTS = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)


def e2m1(values, paired=False):
    """float4_e2m1fn of float32 `values` (NumPy or JAX) in [-6, 6], rounded to nearest even: its code
    counted from the midpoints it passes rather than converted, as XLA cannot convert to E2M1 for sm_120
    (its LLVM has no `llvm.nvvm.ff.to.e2m1x2.rn.satfinite` there: a fatal error). `paired` (JAX only):
    each pair of values swapped, as a weight's stored bytes give them (`weight_parts`)."""
    xp = np if isinstance(values, np.ndarray) else jnp
    magnitude = xp.abs(values)
    codes = sum(
        ((magnitude >= m) if tie_up else (magnitude > m)).astype(np.uint8) for m, tie_up in _MIDPOINTS
    )
    codes = codes | ((values < 0).astype(np.uint8) << np.uint8(3))
    if xp is np:
        return codes.view(ml_dtypes.float4_e2m1fn)
    # Two codes a byte, the first in the low nibble as XLA packs E2M1 (the high one if `paired`).
    first, second = (codes[..., 1::2], codes[..., 0::2]) if paired else (codes[..., 0::2], codes[..., 1::2])
    pairs = first | (second << np.uint8(4))
    return jax.lax.bitcast_convert_type(pairs, jnp.float4_e2m1fn).reshape(codes.shape)


def dequantise(elements, scales, compute: str, tensor=1):
    """float32 [..., K] of `quantise`'s (`elements`, `scales`) over `tensor`."""
    xp = np if isinstance(elements, np.ndarray) else jnp
    block = FORMATS[compute].block
    wide = xp.repeat(scales.astype(np.float32), block, axis=-1)
    return elements.astype(np.float32) * wide * tensor


def weight_parts(raw, compute: str):
    """(elements [out, in], block scales [out, in / block]) of one layer's rows of blocks `raw`
    [out, bytes] (any 8-bit dtype: a stack slices its layers as float8): bytes reinterpreted, not widened;
    NVFP4's with each pair of values swapped (a product with `quantise(..., paired=True)` is the same)."""
    raw = stacks.view(raw, jnp.uint8)
    rows = raw.shape[0]
    if compute == NVFP4:
        blocks = raw.reshape(rows, -1, nvfp4.BLOCK_BYTES)
        # A byte's high nibble is its first value (`nvfp4.dequantise`); bitcast gives the low one first:
        # each pair swapped, as the activations are then quantised (`quantise`'s `paired`), not reversed.
        pairs = jax.lax.bitcast_convert_type(blocks[..., : nvfp4.BLOCK // 2], jnp.float4_e2m1fn)
        elements = pairs.reshape(rows, -1)
        return elements, stacks.view(blocks[..., -1], jnp.float8_e4m3fn)
    blocks = raw.reshape(rows, -1, mxfp8.BLOCK_BYTES)
    elements = stacks.view(blocks[..., : mxfp8.BLOCK], jnp.float8_e4m3fn).reshape(rows, -1)
    return elements, stacks.view(blocks[..., -1], jnp.float8_e8m0fnu)


def product(x, raw, weight_tensor, compute: str, gpu: bool):
    """float32[..., out] of `x` float[..., in] by one layer's rows of blocks `raw` [out, bytes] of format
    `compute` (times their per-tensor scale `weight_tensor`, NVFP4's), `x` quantised per block of `in`:
    cuDNN's block-scaled GEMM on an NVIDIA GPU (`gpu`), the same products of the quantised values in
    float32 elsewhere."""
    *lead, width = x.shape
    rows = x.reshape(-1, width)
    x_tensor = tensor_scale(rows, compute)
    x_elements, x_scales = quantise(rows, compute, x_tensor, paired=True)
    w_elements, w_scales = weight_parts(raw, compute)
    if gpu:
        total = jax.nn.scaled_matmul(x_elements[None], w_elements[None], x_scales[None], w_scales[None])[0]
    else:
        wide_x = dequantise(x_elements, x_scales, compute)
        wide_w = dequantise(w_elements, w_scales, compute)
        total = jnp.dot(wide_x, wide_w.T, preferred_element_type=jnp.float32)
    total = total * x_tensor * (1 if weight_tensor is None else weight_tensor)
    return total.reshape(*lead, -1)


def rows_of_blocks(weight: np.ndarray, compute: str) -> tuple[np.ndarray, np.float32]:
    """(uint8[out, in / block * block bytes] rows of blocks, float32 per-tensor scale) of a float weight
    [out, in], as klein stores a block-scaled Linear (`klein.models.nvfp4`, `klein.models.mxfp8`)."""
    tensor = tensor_scale(weight, compute)
    elements, scales = quantise(np.asarray(weight, np.float32), compute, tensor)
    rows, width = elements.shape
    block = FORMATS[compute].block
    codes = elements.view(np.uint8).reshape(rows, width // block, block)
    if compute == NVFP4:
        codes = (codes[..., 0::2] << np.uint8(4)) | (codes[..., 1::2] & np.uint8(0xF))
    packed = np.concatenate([codes, scales.view(np.uint8)[..., None]], axis=-1)
    return packed.reshape(rows, -1), np.float32(tensor)
