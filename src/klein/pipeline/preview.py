"""Live previews: the denoising loop's latents decoded by TAEF2 (`klein.models.taef2`) after a step, into
approximate images at the output's size (docs/previews.md).

A frame shows the latents as they stand after the step: noise at first, the image emerging as the noise
level falls. A frame costs about a tenth of the VAE's decode (docs/previews.md has the figures), so
callers decode only the frames they show.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import PIL.Image
from flax import nnx

from klein import images, sampling
from klein.errors import InputError
from klein.io import taef2_checkpoint
from klein.models.vae import unpatchify


class Previewer:
    """TAEF2's decoder, jitted (one program per output size), over the latents the step callback sees."""

    def __init__(self, decoder):
        self._graph, self._state = nnx.split(decoder)

    def pixels(self, latents, grid: tuple[int, int]) -> np.ndarray:
        """float32[B, 16h, 16w, 3] in [0, 1] from packed normalised latents float[B, h * w, 4C] (the step
        callback's) of the h x w token `grid`."""
        decoded = _decode(self._graph, self._state, jnp.asarray(latents, jnp.float32), tuple(grid))
        return np.clip(np.asarray(decoded, np.float32), 0.0, 1.0)

    def images(self, latents, grid: tuple[int, int]) -> list[PIL.Image.Image]:
        """`pixels` as RGB images, one per image of the batch."""
        return images.from_float01(self.pixels(latents, grid))


@functools.partial(jax.jit, static_argnums=(0, 3))
def _decode(graph, state, latents, grid):
    return nnx.merge(graph, state)(unpatchify(sampling.unpack(latents, *grid)))


def previewer(preview, latent_channels: int) -> Previewer:
    """The `Previewer` of `preview=`: True for the file at `taef2_checkpoint.default_path()`, or a path;
    loaded once per file (and kept while the file is unchanged)."""
    path = taef2_checkpoint.default_path() if preview is True else Path(preview)
    if not path.is_file():
        raise InputError(taef2_checkpoint.missing_message(path))
    stat = path.stat()
    return _load(str(path.resolve()), (stat.st_mtime_ns, stat.st_size), latent_channels)


@functools.lru_cache(maxsize=2)
def _load(path: str, stamp, latent_channels: int) -> Previewer:
    return Previewer(taef2_checkpoint.load_taef2(path, latent_channels=latent_channels))


class StepKwargs(dict):
    """The dict a diffusers-style step callback receives: "latents", and under `preview=` the step's frames
    as "preview" (RGB images, one per image), decoded when the callback first reads them: a callback that
    shows every fourth step pays for those alone."""

    def __init__(self, latents: np.ndarray, grid, previews: Previewer | None):
        super().__init__(latents=latents)
        self._frames = None if previews is None else functools.partial(previews.images, latents, grid)

    def __missing__(self, key):
        if key != "preview" or self._frames is None:
            raise KeyError(key)
        self[key] = frames = self._frames()
        return frames

    def __contains__(self, key) -> bool:
        return super().__contains__(key) or (key == "preview" and self._frames is not None)

    def get(self, key, default=None):
        return self[key] if key in self else default
