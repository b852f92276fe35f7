"""MXFP8 weights as klein stores them for `compute="mxfp8"` (`klein.models.block_scaled`): a weight
float[out, in] quantised at load to `e4m3 * 2^k`, kept as rows of blocks (`BLOCK` E4M3 values in
`BLOCK_BYTES` bytes, their 32 bytes then their E8M0 scale) as NVFP4's are (`klein.models.nvfp4`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from klein.models import stacks

BLOCK, BLOCK_BYTES = 32, 33


def dequantise(raw):
    """float32[..., rows, columns] of rows of blocks `raw` uint8[..., rows, columns / 32 * 33], NumPy or
    JAX; any 8-bit array is read as its bytes."""
    xp = np if isinstance(raw, np.ndarray) else jnp
    raw = stacks.view(raw, xp.uint8)
    *lead, width = raw.shape
    blocks = raw.reshape(*lead, width // BLOCK_BYTES, BLOCK_BYTES)
    values = stacks.view(blocks[..., :BLOCK], jnp.float8_e4m3fn).astype(np.float32)
    # E8M0 `k` is 2^(k - 127): float32 with k as its exponent bits (k = 0 stands for 2^-127, as zero here).
    scale = stacks.view(blocks[..., BLOCK:].astype(np.uint32) << np.uint32(23), np.float32)
    return (values * scale).reshape(*lead, width // BLOCK_BYTES * BLOCK)
