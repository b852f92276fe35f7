"""One denoising step per mode, as sibling functions (docs/design/requests.md, "Modes").

Each conditioning has its own velocity function with the same signature and its own `cond` value, so
jitted code never dispatches on a type or on None; CFG is its own step function (prompts and negatives
run as one doubled batch). Inpainting and image-to-image add a `Repaint`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from klein import sampling
from klein.errors import InputError
from klein.models import adapters, buckets, step_cache
from klein.models import transformer as T
from klein.models.buckets import Streams
from klein.models.rope import rope_tables
from klein.request.modes import Conditioning, Mode
from klein.request.references import References
from klein.sharding import TOKENS, constrain


def velocity_text(model, x, txt, t, ropes, cond, cache=None):
    img_rope, txt_rope, img_rank = ropes
    return T.forward(model, x, txt, t, img_rope, txt_rope, cache=cache, img_rank=img_rank)


def velocity_references(model, x, txt, t, ropes, cond, cache=None):
    img_rope, txt_rope, img_rank = ropes
    tokens, rope, rank = cond
    refs = (tokens[None], rope)
    return T.forward(model, x, txt, t, img_rope, txt_rope, refs, cache, img_rank=img_rank, ref_rank=rank)


def velocity_cached(model, x, txt, t, ropes, cond, cache=None):
    img_rope, txt_rope, img_rank = ropes
    return T.forward_cached(model, x, txt, t, img_rope, txt_rope, cond, cache=cache, img_rank=img_rank)


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


def step_function(mode: Mode):
    """`fn(model, x, txt, sigma, sigma_next, ropes, cond, scale)`: the step `mode` runs."""
    return functools.partial(step_cfg if mode.guided else step, VELOCITY[mode.conditioning])


def cached_step(
    velocity, passes: int, structure, model, x, txt, sigma, sigma_next, ropes, cond, scale, cache
):
    """One Euler step under a step cache (`klein.models.step_cache`): `cache` = (states, knobs), a state
    per pass. Without guidance one pass; with it either one doubled pass whose image and negative rows
    decide together (`passes` 1), or a pass for the prompts and one for the negatives, each deciding on its
    own, as cache-dit's separate CFG (`passes` 2). Returns (x, (states, records [pass, group, ...]))."""
    states, knobs = cache
    b = x.shape[0]
    probe = states == step_cache.PROBE

    def run(x, txt, state, knobs):
        t = jnp.full((x.shape[0],), sigma, jnp.float32)
        return velocity(model, x, txt, t, ropes, cond, cache=T.Cached(structure, state, knobs))

    if passes == 2:
        outs = []
        for index in range(2):
            with adapters.batch_slice(index * b, (index + 1) * b):
                outs.append(
                    run(x, txt[index * b : (index + 1) * b], states if probe else states[index], knobs)
                )
        (cond_v, (cond_state, cond_record)), (uncond_v, (uncond_state, uncond_record)) = outs
        v = sampling.guided(cond_v, uncond_v, scale)
        states, records = (cond_state, uncond_state), (cond_record, uncond_record)
    else:
        guided = txt.shape[0] != b
        v, (state, record) = run(
            jnp.concatenate([x, x]) if guided else x, txt, states if probe else states[0], knobs
        )
        if guided:
            v = sampling.guided(*jnp.split(v, 2), scale)
        states, records = (state,), (record,)
    x = constrain(sampling.euler_step(x, v, sigma, sigma_next), TOKENS)
    return x, (states, None if probe else jax.tree.map(lambda *r: jnp.stack(r), *records))


def cached_step_function(mode: Mode, passes: int, structure):
    """`fn(model, x, txt, sigma, sigma_next, ropes, cond, scale, (states, knobs))`: `mode`'s step under a
    step cache of `structure`, in `passes` passes (`cached_step`)."""
    return functools.partial(cached_step, VELOCITY[mode.conditioning], passes, structure)


def cache_states_function(mode: Mode, passes: int, structure):
    """`fn(model, x, txt, sigma, sigma_next, ropes, cond, scale, knobs)`: the states before the first step
    of `cached_step_function(mode, passes, structure)` (zeros; only their shapes are ever traced)."""
    return functools.partial(_cache_states, cached_step_function(mode, passes, structure))


def _cache_states(step, model, x, txt, sigma, sigma_next, ropes, cond, scale, knobs):
    return step(model, x, txt, sigma, sigma_next, ropes, cond, scale, (step_cache.PROBE, knobs))[1][0]


def step_inputs(
    rope, conditioning: Conditioning, grid, text_tokens: int, references: References | None, streams: Streams
):
    """(ropes, cond) of every step of a request: the rope tables of the h x w token `grid` and of the
    text and the image's rank (`padded_stream`), and the conditioning's own value; the image and the
    references padded to `streams`. `rope(ids)`: the rope tables of position ids (`rope_of`, or a cache of
    it). What the pipeline runs and what `klein plan --compiled` compiles."""
    h, w = grid
    img_ids, img_rank = padded_stream(sampling.image_ids(h, w), streams.image, streams.masked)
    ropes = (rope(img_ids), rope(sampling.text_ids(text_tokens)), img_rank)
    cond = {
        Conditioning.TEXT: lambda: (),
        Conditioning.REFERENCES: lambda: prefill_inputs(rope, references, streams),
        Conditioning.CACHED: lambda: references.kv,
    }[conditioning]()
    return ropes, cond


def prefill_inputs(rope, references: References, streams: Streams) -> tuple:
    """(tokens, rope tables, rank) of `references` padded to `streams.references` tokens, as the prefill
    and the steps of standard editing take them; `rope` as `step_inputs`'."""
    ids, rank = padded_stream(references.ids, streams.references, streams.masked)
    tokens, extra = references.tokens, streams.references - references.tokens.shape[0]
    if extra:  # on the host: a device program would be one per count of tokens
        tokens = to_device(buckets.pad(np.asarray(tokens), streams.references))
    return tokens, rope(ids), rank


def padded_stream(ids: np.ndarray, padded: int, masked: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """The position ids int[S, 4] of a stream padded to `padded` tokens (zeros after its own) and its rank
    int32[padded] (`buckets.ranks`) when `masked`, else None (the unmasked kernel: nothing padded)."""
    if not masked:
        return ids, None
    return buckets.pad(ids, padded), buckets.ranks(len(ids), padded)


def to_device(array, dtype=None) -> jax.Array:
    """A host array on the default device, converted to `dtype` on the host first: a transfer, where
    `jnp.asarray` builds a small program per shape (a new size's would be built in the foreground)."""
    return jax.device_put(np.asarray(array, dtype))


def to_host(array: jax.Array) -> np.ndarray:
    """`array`'s values on the host, whole: gathered from every process where its shards span several
    (a mesh across processes; every process calls this, in step)."""
    if array.is_fully_addressable or array.is_fully_replicated:
        return np.asarray(array)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def rope_of(config, ids: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """The rope tables (cos, sin) float32[S, Dh] of position ids int[S, 4] under a transformer config."""
    tables = rope_tables(np.ascontiguousarray(ids, np.int64), config.axes_dims_rope, config.rope_theta)
    return tuple(to_device(t) for t in tables)


def pad_batch(x, txt, guided: bool, ways: int, to: int | None = None):
    """Pad the batch with zero images (and their zero prompts) to a multiple of `ways` (the mesh's batch
    axes), so that it splits over the devices, or to `to` images (a warm program's batch: a multiple of
    `ways` too); the caller drops them. Images never see each other."""
    extra = -x.shape[0] % ways if to is None else to - x.shape[0]
    if not extra:
        return x, txt

    def pad(a):
        return jnp.pad(a, [(0, extra)] + [(0, 0)] * (a.ndim - 1))

    # With CFG txt is [prompts; negatives]: each half grows, so that halves still pair up.
    texts = jnp.split(txt, 2) if guided else [txt]
    return pad(x), jnp.concatenate([pad(t) for t in texts])


@dataclasses.dataclass(frozen=True)
class Repaint:
    """What inpainting and image-to-image add to the steps (docs/design.md, "Inpainting")."""

    source: jax.Array
    """float[1, N, C]: the source image's tokens (the first reference's), zeros over the image stream's
    padding (N counts it: the token bucket's)."""
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


def batch_rows(adapted, batch: int, guided: bool):
    """The rows of unmerged LoRAs for the transformer's batch: padding images (`pad_batch`) use
    none, and under CFG the negatives run under their image's LoRAs, as the batch is doubled."""
    if adapted is None:
        return None
    bank, rows = adapted
    rows = np.pad(rows, [(0, batch - len(rows)), (0, 0)])
    return bank, np.concatenate([rows, rows]) if guided else rows


def step_end(callback, step: int, sigma: float, x, images: int, grid: tuple[int, int]):
    """Hand the step's latents (the first `images` images' tokens of the h x w token `grid`: no padding)
    and the grid to a diffusers-style callback; take back the latents it returns."""
    tokens = grid[0] * grid[1]
    outputs = callback(step, float(sigma) * 1000, np.asarray(x[:images, :tokens], np.float32), grid) or {}
    if not isinstance(outputs, dict):
        raise InputError(f"callback_on_step_end must return a dict (or None), got {type(outputs).__name__}")
    latents = outputs.get("latents")
    if latents is None:
        return x
    latents, shape = np.asarray(latents, np.float32), (images, tokens, x.shape[2])
    if latents.shape != shape:
        raise InputError(
            f"callback_on_step_end returned latents of shape {latents.shape}; they must keep the shape {shape}"
        )
    return x.at[:images, :tokens].set(jnp.asarray(latents, x.dtype))


def pad_tokens(x, tokens: int):
    """x [B, N, ...] with zero tokens appended up to `tokens` (a token bucket's padding)."""
    extra = tokens - x.shape[1]
    return jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2)) if extra else x
