"""NVFP4 weights (BFL's `flux-2-klein-*-nvfp4.safetensors`, ComfyUI's "nvfp4") as klein stores them: a
weight float[out, in] is `e2m1 * e4m3 * tensor_scale`, kept as rows of blocks (`BLOCK` E2M1 values in
`BLOCK_BYTES` bytes, their 8 bytes then their E4M3 scale) as GGUF's are; NumPy arranges a file's tensors
at load, JAX widens one layer inside the compiled program (docs/design/checkpoints.md, "How a stored
layer becomes a product").
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from einops import rearrange

from klein.models import stacks

BLOCK, BLOCK_BYTES = 16, 9
TILE_ROWS, TILE_BLOCKS = 128, 4


def swizzled_size(rows: int, columns: int) -> int:
    """Bytes of the padded, swizzled block scales of a [rows, columns] weight."""
    return _up(rows, TILE_ROWS) * _up(columns // BLOCK, TILE_BLOCKS)


def block_scales(swizzled: np.ndarray, rows: int, blocks: int) -> np.ndarray:
    """The [rows, blocks] scales (bytes) of a weight from their swizzled, padded layout (any shape)."""
    tiles_down, tiles_across = _up(rows, TILE_ROWS) // TILE_ROWS, _up(blocks, TILE_BLOCKS) // TILE_BLOCKS
    # byte index = ((tile_down * tiles_across + tile_across) * 32 + r % 32) * 16 + (r % 128 // 32) * 4 + c % 4
    tiles = np.asarray(swizzled).view(np.uint8).reshape(tiles_down, tiles_across, 32, 4, TILE_BLOCKS)
    logical = rearrange(tiles, "down across r32 r4 c -> (down r4 r32) (across c)")
    return logical[:rows, :blocks]


def as_blocks(packed: np.ndarray, swizzled: np.ndarray) -> np.ndarray:
    """klein's uint8[out, in / 16 * 9] rows of blocks from a file's packed values uint8[out, in / 2] and
    swizzled scales."""
    rows, half = packed.shape
    blocks = half * 2 // BLOCK
    scales = block_scales(swizzled, rows, blocks)
    values = np.asarray(packed).view(np.uint8).reshape(rows, blocks, BLOCK // 2)
    return np.concatenate([values, scales[..., None]], axis=-1).reshape(rows, blocks * BLOCK_BYTES)


def dequantise(raw):
    """float32[..., rows, columns] (`e2m1 * e4m3`, without the per-tensor scale) of rows of blocks
    `raw` uint8[..., rows, columns / 16 * 9], NumPy or JAX; any 8-bit array is read as its bytes (a stack
    slices its layers as float8, `klein.models.stacks`)."""
    xp = np if isinstance(raw, np.ndarray) else jnp
    raw = stacks.view(raw, xp.uint8)
    *lead, width = raw.shape
    blocks = raw.reshape(*lead, width // BLOCK_BYTES, BLOCK_BYTES)
    pairs = blocks[..., : BLOCK // 2]
    codes = xp.stack([pairs >> np.uint8(4), pairs & np.uint8(0xF)], axis=-1)
    values = e2m1(codes.reshape(*lead, width // BLOCK_BYTES, BLOCK), xp)
    scale = stacks.view(blocks[..., BLOCK // 2 :], jnp.float8_e4m3fn).astype(np.float32)
    return (values * scale).reshape(*lead, width // BLOCK_BYTES * BLOCK)


def e2m1(codes, xp=jnp):
    """float32 of E2M1 `codes` (uint8; 0-7: 0, 0.5, 1, 1.5, 2, 3, 4, 6, 8-15 their negatives), built from
    their bits rather than looked up: XLA:CPU reads a table one value at a time, shifts and masks it
    vectorises.
    A code's 3 magnitude bits (exponent e, mantissa m) placed at bit 22 give float32's exponent's low bits
    and mantissa's top one; adding 126 to the exponent makes it 2^(e - 1) (1 + m / 2) for e > 0. The two
    codes with e = 0 are 0 and 0.5 (0x3F000000)."""
    codes = codes.astype(np.uint32)
    magnitude = codes & np.uint32(7)
    normal = (magnitude << np.uint32(22)) + np.uint32(126 << 23)
    bits = xp.where(magnitude < 2, magnitude * np.uint32(0x3F000000), normal)
    return stacks.view(bits | ((codes & np.uint32(8)) << np.uint32(28)), np.float32)


def _up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
