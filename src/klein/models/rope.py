"""Rotary position embedding of FLUX.2: 4 position axes (t, h, w, l), interleaved pairs.

Tables are computed on the host in float64 (positions are a function of static shapes only), then
rounded once to float32, as the reference does; rotation itself runs in float32 on the device.

Shapes: ids int[S, 4]; tables (cos, sin) float32[S, Dh] with Dh = sum(axes_dims).
"""

import jax.numpy as jnp
import numpy as np


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


def apply_rope(x: jnp.ndarray, table: tuple) -> jnp.ndarray:
    """Rotate x float[B, S, H, Dh] by the tables [S, Dh]."""
    cos, sin = (t[None, :, None, :] for t in table)
    x32 = x.astype(jnp.float32)
    pairs = x32.reshape(*x.shape[:-1], -1, 2)
    rotated = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)
    return (x32 * cos + rotated * sin).astype(x.dtype)
