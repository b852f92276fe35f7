"""One denoising step per mode, as sibling functions (docs/design.md, "Modes").

Each conditioning has its own velocity function with the same signature; its `cond` is that mode's
own value (nothing for text-to-image, (reference tokens, rope) for references with full attention, a
`ReferenceKV` for cached references), so jitted code never dispatches on a type or on None. CFG is
its own step function: prompts and negatives run as one doubled batch.
"""

from __future__ import annotations

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
