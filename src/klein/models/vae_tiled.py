"""Decoding in tiles (docs/design/memory.md, "Decoding memory"): a bounded amount of memory at any size,
for outputs whose plain decode (`klein.models.vae.decode_latents`) does not fit."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from klein.models.vae import _PATCH, AutoencoderKLFlux2, vae_latents

TILE, OVERLAP = 64, 16
"""diffusers' tiling defaults, in tokens of 16 px: 1024 px tiles, 256 px blend."""


def tiling(rows: int, columns: int) -> tuple[int, int]:
    """(tile, overlap) in tokens for latents of `rows` x `columns` tokens: diffusers' defaults, but where
    those hold the whole image in one tile (saving nothing: 1024^2 and below) two tiles a side overlapping
    by an eighth of it, each about a third of the image's area."""
    longest = max(rows, columns)
    if longest > TILE or longest < 4:
        return TILE, OVERLAP
    overlap = longest // 8
    return -(-(longest + overlap) // 2), overlap


def decode_latents_tiled(
    vae: AutoencoderKLFlux2, latents: jax.Array, *, tile: int | None = None, overlap: int | None = None
) -> jax.Array:
    """`decode_latents` in overlapping square tiles of `tile` tokens (16 px each), blended linearly;
    by default as `tiling` lays them for the latents' size.

    Memory is that of one plain decode of a `16 * tile` px square (tiles run one after another), for
    any image size. Not exact: each tile takes GroupNorm statistics and attention context from its own
    area only, so the result drifts from the plain decode by as much as diffusers' `tiled_decode` does
    (tested); the linear blend over `overlap` tokens hides the seams. Edge tiles are moved inwards rather
    than cropped, so every tile has the same shape (one compilation).
    """
    if tile is None or overlap is None:
        tile, overlap = tiling(*latents.shape[1:3])
    if not 0 <= overlap < tile:
        raise ValueError(f"tiles of {tile} tokens cannot overlap by {overlap}")
    z = vae_latents(vae, latents)
    _, h, w, _ = z.shape
    rows = tile_starts(h, _PATCH * tile, _PATCH * overlap)
    cols = tile_starts(w, _PATCH * tile, _PATCH * overlap)
    size_h, size_w = min(h, _PATCH * tile), min(w, _PATCH * tile)
    tiles = jnp.stack([z[:, y : y + size_h, x : x + size_w] for y in rows for x in cols])
    # lax.map runs the tiles sequentially inside one program, so only one tile's activations are live.
    images = jax.lax.map(vae.decode, tiles)
    scale = vae.config.downscale
    starts = [(y * scale, x * scale) for y in rows for x in cols]
    return _blend(images, starts, (h * scale, w * scale), _PATCH * overlap * scale)


def tile_starts(size: int, tile: int, overlap: int) -> list[int]:
    """Tile offsets along one axis: a stride of `tile - overlap`, the last tile flush with the end."""
    if size <= tile:
        return [0]
    return [*range(0, size - tile, tile - overlap), size - tile]


def _blend(images: jax.Array, starts: list, size: tuple[int, int], ramp: int) -> jax.Array:
    """Weighted average of decoded tiles float[N, B, th, tw, 3] whose top-left pixels are `starts`."""
    _, b, th, tw, c = images.shape
    height, width = size
    total = jnp.zeros((b, height, width, c), jnp.float32)
    weight = jnp.zeros((height, width), jnp.float32)
    for image, (y, x) in zip(images, starts, strict=True):
        tile_weight = jnp.outer(_window(y, th, height, ramp), _window(x, tw, width, ramp))
        total = total.at[:, y : y + th, x : x + tw].add(tile_weight[:, :, None] * image)
        weight = weight.at[y : y + th, x : x + tw].add(tile_weight)
    return (total / weight[:, :, None]).astype(images.dtype)


def _window(start: int, length: int, size: int, ramp: int) -> jax.Array:
    """Blend weights of one tile along one axis: linear ramps over `ramp` px at edges inside the image."""
    pos = jnp.arange(length, dtype=jnp.float32) + 0.5
    up = jnp.minimum(pos / ramp, 1.0) if start > 0 else 1.0
    down = jnp.minimum((length - pos) / ramp, 1.0) if start + length < size else 1.0
    return jnp.ones((length,), jnp.float32) * up * down
