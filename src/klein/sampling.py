"""Flow-matching sampling for FLUX.2 [klein]: schedule, position ids, latent packing, Euler steps.

Pure functions. Axes: B batch, C = 128 token channels, h x w latent grid (one token per 16x16 px),
N = h * w image tokens, T text tokens.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

# Empirical fit of the schedule shift `mu` to the image token count and step count (from BFL).
_A1, _B1 = 8.73809524e-05, 1.89833333
_A2, _B2 = 0.00016927, 0.45666666


def empirical_mu(image_tokens: int, num_steps: int) -> float:
    """Shift for `image_tokens` output tokens (references do not count) and `num_steps` steps."""
    m200 = _A2 * image_tokens + _B2
    if image_tokens > 4300:
        return m200
    m10 = _A1 * image_tokens + _B1
    slope = (m200 - m10) / 190.0
    return slope * num_steps + (m200 - 200.0 * slope)


def sigmas(num_steps: int, image_tokens: int, given=None) -> np.ndarray:
    """float32[steps + 1]: `given` (default linspace(1, 1/N, N), N = num_steps) shifted by exp(mu), mu read
    at num_steps, then a final 0. As diffusers, a given schedule sets the step count and num_steps only the
    shift."""
    mu = empirical_mu(image_tokens, num_steps)
    base = np.linspace(1.0, 1.0 / num_steps, num_steps) if given is None else np.asarray(given, np.float64)
    shifted = math.exp(mu) / (math.exp(mu) + (1.0 / base - 1.0))
    return np.append(shifted, 0.0).astype(np.float32)


def euler_step(x: jnp.ndarray, velocity: jnp.ndarray, sigma, sigma_next) -> jnp.ndarray:
    return (x.astype(jnp.float32) + (sigma_next - sigma) * velocity.astype(jnp.float32)).astype(x.dtype)


def noised(source: jnp.ndarray, noise: jnp.ndarray, sigma) -> jnp.ndarray:
    """The source's tokens noised to `sigma` (the flow's straight path; diffusers' `scale_noise`), float32."""
    return sigma * noise.astype(jnp.float32) + (1.0 - sigma) * source.astype(jnp.float32)


def guided(cond: jnp.ndarray, uncond: jnp.ndarray, scale: float) -> jnp.ndarray:
    """Classifier-free guidance (base variants, negative prompt "")."""
    return uncond + scale * (cond - uncond)


def pack(latents: np.ndarray) -> np.ndarray:
    """[B, C, h, w] (diffusers' `latents` layout) -> tokens [B, h*w, C], row-major."""
    b, c, h, w = latents.shape
    return latents.reshape(b, c, h * w).transpose(0, 2, 1)


def unpack(tokens: jnp.ndarray, h: int, w: int) -> jnp.ndarray:
    """Tokens [B, h*w, C] -> channels-last grid [B, h, w, C]."""
    return tokens.reshape(tokens.shape[0], h, w, tokens.shape[-1])


def image_ids(h: int, w: int, t: int = 0) -> np.ndarray:
    """Position ids (t, row, col, 0) of an h x w token grid, row-major: int[h*w, 4]."""
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    return np.stack([np.full(h * w, t), rows.ravel(), cols.ravel(), np.zeros(h * w)], -1).astype(np.int64)


def reference_ids(grids: list[tuple[int, int]]) -> np.ndarray:
    """Ids of all references concatenated; reference i (0-based) sits at time 10 + 10 i."""
    return np.concatenate([image_ids(h, w, 10 + 10 * i) for i, (h, w) in enumerate(grids)])


def text_ids(length: int) -> np.ndarray:
    """Text token l sits at (0, 0, 0, l): int[length, 4]."""
    return np.stack([*[np.zeros(length)] * 3, np.arange(length)], -1).astype(np.int64)
