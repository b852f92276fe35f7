"""Rotary position embedding of FLUX.2: 4 position axes (t, h, w, l), interleaved pairs.

Tables are computed on the host in float64 (positions are a function of static shapes only), then
rounded once to float32, as the reference does; rotation itself runs in float32 on the device.

Shapes: ids int[S, 4]; tables (cos, sin) float32[S, Dh] with Dh = sum(axes_dims).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from klein import sharding


def rope_tables(ids: np.ndarray, axes_dims: tuple[int, ...], theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos / sin tables for position ids [S, n_axes]; each axis owns `axes_dims[i]` channels."""
    ids = np.asarray(ids, dtype=np.float64)
    freqs = [1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim) for dim in axes_dims]
    angles = np.concatenate([np.outer(ids[:, axis], f) for axis, f in enumerate(freqs)], axis=1)
    # Each frequency drives one (real, imaginary) pair of adjacent channels.
    angles = np.repeat(angles, 2, axis=1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def concat_tables(*tables: tuple) -> tuple:
    """Tables of consecutive token groups, joined in sequence order."""
    return tuple(jnp.concatenate([t[i] for t in tables], axis=0) for i in range(2))


def apply_rope(x: jnp.ndarray, table: tuple, heads_first: bool = False) -> jnp.ndarray:
    """Rotate x float[B, S, H, Dh] (`heads_first`: [B, H, S, Dh]) by the tables [S, Dh]: channel pair
    (2i, 2i + 1) of each head turned by its angle, `x * cos + swapped * sin` in float32, the pairs swapped
    by `pair_swapped` in a TPU's program, by a reshape to pairs elsewhere (the same values, bit for bit)."""
    cos, sin = (t[None, None] if heads_first else t[None, :, None, :] for t in table)
    x32 = x.astype(jnp.float32)
    if sharding.platform() == "tpu":
        swapped = pair_swapped(x)
    else:
        pairs = x32.reshape(*x.shape[:-1], -1, 2)
        swapped = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)
    return (x32 * cos + swapped * sin).astype(x.dtype)


def pair_swapped(x: jnp.ndarray) -> jnp.ndarray:
    """float32 [-x1, x0, -x3, x2, ...] of x float[..., Dh]: each channel pair's (-imaginary, real).

    A product with a fixed signed permutation [Dh, Dh] (`swap_matrix`), exact (one nonzero of magnitude 1
    per output, accumulated in float32; float32 inputs at full precision), rather than a reshape to pairs
    [..., Dh / 2, 2]: a last axis of 2 cannot sit in a TPU's 128 lanes, and XLA moved every q and k through
    float32 copies of other layouts to make it (a v5e's klein-4b step: `benchmarks/tpu/tpu_step_hlo.py`)."""
    swap = jnp.asarray(swap_matrix(x.shape[-1]), x.dtype)
    return jnp.einsum(
        "...d,de->...e", x, swap, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )


@functools.cache
def swap_matrix(dim: int) -> np.ndarray:
    """float32[dim, dim] P with `x @ P` = [-x1, x0, -x3, x2, ...]."""
    swap = np.zeros((dim, dim), np.float32)
    swap[np.arange(1, dim, 2), np.arange(0, dim, 2)] = -1.0
    swap[np.arange(0, dim, 2), np.arange(1, dim, 2)] = 1.0
    return swap
