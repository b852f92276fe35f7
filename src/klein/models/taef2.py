"""TAEF2's decoder (Ollin Boer Bohan's Tiny AutoEncoder for FLUX.2, github.com/madebyollin/taesd) in Flax
NNX, channels-last: 1.34 M parameters (2.7 MB in fp16) that turn FLUX.2 latents into an approximate
image, for previews while the denoising loop runs (docs/previews.md).

Axes as in `klein.models.vae`: y, x the VAE's latent grid (1/8 of the image), Y, X the image.

- input: float[B, y, x, C] the *normalised* latents, unpatchified: the transformer's 128 channels
  (`klein.models.vae.unpatchify`) as C = 32 channels on the 2x finer grid. TAEF2 shares the latent space
  the diffusion model sees (its encoder's output, patchified, is what ComfyUI feeds FLUX.2, and what its
  previewer decodes), so no BatchNorm statistics are undone first;
- output: float[B, Y, X, 3], about [0, 1] (not clipped).

The layers, in the order of the published weights (`klein.io.taef2_checkpoint` names their keys): a soft
clamp of the latents to about [-3, 3], a 3x3 conv to 64 channels, then four levels of residual conv blocks
with a 2x nearest-neighbour upsampling and a 3x3 conv between levels (8x in all), and a 3x3 conv to RGB.
The first level's blocks each add a pointwise branch with a GroupNorm (statistics over the whole image),
which TAEF2 needed to match FLUX.2's colours.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from klein.models.vae import GroupNorm

WIDTH = 64
"""Channels of every hidden layer."""
LEVEL_BLOCKS = (3, 3, 3, 1)
"""Residual blocks per level, lowest resolution first; the first level's have the GroupNorm branch."""
_POOL_GROUPS = 4  # GroupNorm groups of the pointwise branch, over 4 x WIDTH channels
_POOL_EPS = 1e-5  # torch's GroupNorm default, which the reference uses
_CLAMP = 3.0  # latents pass through 3 tanh(z / 3): near the identity within [-1, 1], bounded by 3


def _conv(cin: int, cout: int, size: int = 3, *, bias: bool = True, rngs, param_dtype) -> nnx.Conv:
    return nnx.Conv(
        cin, cout, (size, size), padding="SAME", use_bias=bias, rngs=rngs, param_dtype=param_dtype
    )


class PointwiseNorm(nnx.Module):
    """1x1 conv to 4x the channels -> GroupNorm -> ReLU -> 1x1 conv back, added to a block's input: the only
    place where a pixel's output depends on the whole image (the GroupNorm's statistics)."""

    def __init__(self, channels: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        wide = 4 * channels
        self.expand = _conv(channels, wide, 1, bias=False, **kw)
        self.norm = GroupNorm(
            wide, _POOL_GROUPS, epsilon=_POOL_EPS, use_fast_variance=False, rngs=rngs, param_dtype=param_dtype
        )
        self.project = _conv(wide, channels, 1, bias=False, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.project(nnx.relu(self.norm(self.expand(x))))


class Block(nnx.Module):
    """(x + the pointwise branch, if any) -> conv -> ReLU -> conv -> ReLU -> conv, plus that input, then
    ReLU. Input and output widths are equal, so the skip is the identity."""

    def __init__(self, channels: int, pooled: bool, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.convs = nnx.List([_conv(channels, channels, **kw) for _ in range(3)])
        self.pool = PointwiseNorm(channels, **kw) if pooled else None

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.pool is not None:
            x = x + self.pool(x)
        h = nnx.relu(self.convs[0](x))
        h = nnx.relu(self.convs[1](h))
        return nnx.relu(self.convs[2](h) + x)


class TAEF2Decoder(nnx.Module):
    """Normalised, unpatchified FLUX.2 latents -> an approximate image (module docstring)."""

    def __init__(self, latent_channels: int = 32, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.latent_channels = latent_channels
        self.conv_in = _conv(latent_channels, WIDTH, **kw)
        self.blocks = nnx.List(
            [Block(WIDTH, level == 0, **kw) for level, count in enumerate(LEVEL_BLOCKS) for _ in range(count)]
        )
        self.ups = nnx.List([_conv(WIDTH, WIDTH, bias=False, **kw) for _ in LEVEL_BLOCKS[1:]])
        self.conv_out = _conv(WIDTH, 3, **kw)

    def __call__(self, z: jax.Array) -> jax.Array:
        """float[B, y, x, C] -> float[B, 8y, 8x, 3], about [0, 1]."""
        h = nnx.relu(self.conv_in(_CLAMP * jnp.tanh(z / _CLAMP)))
        blocks = iter(self.blocks)
        for level, count in enumerate(LEVEL_BLOCKS):
            if level:
                h = self.ups[level - 1](jnp.repeat(jnp.repeat(h, 2, axis=1), 2, axis=2))
            for _ in range(count):
                h = next(blocks)(h)
        return self.conv_out(h)
