"""One denoising step per mode, as sibling functions (docs/design.md, "Modes").

Inpainting and image-to-image (`Repaint`) start later in the schedule from the noised source, and
after each step put the source back, noised to the next step's level, wherever the mask keeps it.

Each conditioning has its own velocity function with the same signature; its `cond` is that mode's
own value (nothing for text-to-image, (reference tokens, rope) for references with full attention, a
`ReferenceKV` for cached references), so jitted code never dispatches on a type or on None. CFG is
its own step function: prompts and negatives run as one doubled batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from klein import sampling
from klein.models import transformer as T
from klein.request.modes import Conditioning
from klein.sharding import TOKENS, constrain


def velocity_text(model, x, txt, t, ropes, cond):
    img_rope, txt_rope = ropes
    return T.forward(model, x, txt, t, img_rope, txt_rope)


def velocity_references(model, x, txt, t, ropes, cond):
    img_rope, txt_rope = ropes
    tokens, rope = cond
    return T.forward(model, x, txt, t, img_rope, txt_rope, refs=(tokens[None], rope))


def velocity_cached(model, x, txt, t, ropes, cond):
    img_rope, txt_rope = ropes
    return T.forward_cached(model, x, txt, t, img_rope, txt_rope, cond)


VELOCITY = {
    Conditioning.TEXT: velocity_text,
    Conditioning.REFERENCES: velocity_references,
    Conditioning.CACHED: velocity_cached,
}


def step(velocity, model, x, txt, sigma, sigma_next, ropes, cond, scale):
    """One Euler step (`scale` unused: the same arguments as `step_cfg`)."""
    t = jnp.full((x.shape[0],), sigma, jnp.float32)
    v = velocity(model, x, txt, t, ropes, cond)
    # The same layout in as out: every step reuses one compiled program.
    return constrain(sampling.euler_step(x, v, sigma, sigma_next), TOKENS)


def step_cfg(velocity, model, x, txt, sigma, sigma_next, ropes, cond, scale):
    """One guided Euler step: txt holds [prompts; negatives], the batch runs once, doubled."""
    x_in = jnp.concatenate([x, x])
    t = jnp.full((x_in.shape[0],), sigma, jnp.float32)
    v = sampling.guided(*jnp.split(velocity(model, x_in, txt, t, ropes, cond), 2), scale)
    return constrain(sampling.euler_step(x, v, sigma, sigma_next), TOKENS)


@dataclasses.dataclass(frozen=True)
class Repaint:
    """What inpainting and image-to-image add to the steps (docs/design.md, "Inpainting")."""

    source: jax.Array
    """float[1, N, C]: the source image's tokens (the first reference's)."""
    noise: jax.Array
    """float[B, N, C]: the noise the steps started from, which re-noises the source after each step."""
    mask: jax.Array | None
    """float32[1, N, 1]: 1 repaints a token, 0 keeps the source; None repaints everything."""
    noised_start: bool = True
    """Start from the source noised to the first step's level; False when the caller gave the latents,
    which are then both the noise and the start, as in diffusers' inpainting pipeline."""

    def padded(self, batch: int) -> Repaint:
        """The same with the noise padded with zeros to `batch` images (the mesh's padding)."""
        extra = batch - self.noise.shape[0]
        noise = jnp.pad(self.noise, [(0, extra), (0, 0), (0, 0)]) if extra else self.noise
        return dataclasses.replace(self, noise=noise)

    def start(self, sigma) -> jax.Array:
        """The latents the steps start from: the source noised to the first step's level."""
        return _start(self.source, self.noise, sigma)

    def after_step(self, x, sigma_next) -> jax.Array:
        """`x` after a step, with the source noised to the next level wherever the mask keeps it (the
        clean source after the last step, whose next level is 0); unchanged without a mask."""
        return x if self.mask is None else _keep_unmasked(x, self.source, self.noise, self.mask, sigma_next)


@jax.jit
def _start(source, noise, sigma):
    return sampling.noised(source, noise, sigma).astype(noise.dtype)


@jax.jit
def _keep_unmasked(x, source, noise, mask, sigma_next):
    kept = sampling.noised(source, noise, sigma_next)
    return ((1 - mask) * kept + mask * x.astype(jnp.float32)).astype(x.dtype)
