"""The FLUX.2 VAE (diffusers' AutoencoderKLFlux2) in Flax NNX, channels-last.

Axes: B batch; Y, X image height and width in pixels (multiples of 16); y = Y/8, x = X/8 the VAE's
latent grid; Y/16, X/16 the transformer's token grid (one token = a 2x2 patch of VAE latents).

- images: float[B, Y, X, 3] in [-1, 1] (decoded images are not clipped);
- VAE latents: float[B, y, x, 32], the mean of the encoder's Gaussian (FLUX.2 never samples it);
- normalised latents: float[B, Y/16, X/16, 128], what the transformer consumes before flattening:
  2x2 patches of VAE latents, channel `4 * c + 2 * dy + dx`, normalised with the BatchNorm running
  statistics as `(z - mean) / sqrt(var + eps)`.

`klein.models.vae_tiled.decode_latents_tiled` holds a bounded amount of memory at any size, for outputs
whose plain decode does not fit (docs/design/memory.md, "Decoding memory"); `klein.models.vae_canvas` runs
an image inside a larger canvas, the padding masked.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from einops import rearrange
from flax import nnx

from klein.errors import CheckpointError
from klein.models import transcendentals, vae_canvas
from klein.models.attention import Keys, attend
from klein.models.facts import PIXELS_PER_TOKEN  # noqa: F401 - where code with a VAE looks for it

_PATCH = 2  # latents are patchified 2x2 into transformer channels
_NORM_EPS = 1e-6  # every GroupNorm of the diffusers encoder / decoder


@dataclasses.dataclass(frozen=True)
class VAEConfig:
    """Hyperparameters of AutoencoderKLFlux2; names and defaults follow diffusers' `vae/config.json`."""

    in_channels: int = 3
    """Channels of the images the encoder reads."""
    out_channels: int = 3
    """Channels of the images the decoder writes."""
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    """Encoder width per resolution level, full resolution first; each level but the last halves Y, X."""
    decoder_block_out_channels: tuple[int, ...] | None = None
    """Decoder width per level (full resolution first); None means `block_out_channels`."""
    layers_per_block: int = 2
    """ResNet blocks per encoder level; decoder levels have one more."""
    norm_num_groups: int = 32
    """GroupNorm groups everywhere."""
    latent_channels: int = 32
    """Channels of the VAE latent (before 2x2 patchifying)."""
    mid_block_add_attention: bool = True
    """Whether the encoder and decoder mid-blocks hold a single-head self-attention."""
    use_quant_conv: bool = True
    """Whether a 1x1 conv follows the encoder (on mean and log-variance)."""
    use_post_quant_conv: bool = True
    """Whether a 1x1 conv precedes the decoder."""
    batch_norm_eps: float = 1e-4
    """Epsilon of the latent normalisation `(z - mean) / sqrt(var + eps)`."""

    @classmethod
    def flux2(cls) -> VAEConfig:
        """The released FLUX.2 VAE, shared by every klein variant (diffusers' defaults)."""
        return cls()

    @classmethod
    def from_diffusers_config(cls, config: dict) -> VAEConfig:
        """Read diffusers' `vae/config.json` (as a dict); absent fields take diffusers' defaults."""
        _check_supported(config)
        names = {field.name for field in dataclasses.fields(cls)}
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items() if k in names}
        return cls(**values)

    @property
    def decoder_channels(self) -> tuple[int, ...]:
        return self.decoder_block_out_channels or self.block_out_channels

    @property
    def downscale(self) -> int:
        """Pixels per VAE latent along each side (8 for FLUX.2)."""
        return 2 ** (len(self.block_out_channels) - 1)

    @property
    def pixels_per_token(self) -> int:
        """Pixels along each side of one transformer token: `downscale` x the 2x2 patch (16 for FLUX.2)."""
        return self.downscale * _PATCH


def _check_supported(config: dict) -> None:
    """Reject settings this implementation fixes instead of reading: they would load, then compute wrongly."""
    problems = []
    if config.get("act_fn", "silu") != "silu":
        problems.append(f"act_fn={config['act_fn']!r}")
    if list(config.get("patch_size", [_PATCH, _PATCH])) != [_PATCH, _PATCH]:
        problems.append(f"patch_size={config['patch_size']!r}")
    encoder_levels = len(config.get("block_out_channels") or VAEConfig.block_out_channels)
    decoder_levels = len(config.get("decoder_block_out_channels") or ()) or encoder_levels
    for key, kind, levels in (
        ("down_block_types", "DownEncoderBlock2D", encoder_levels),
        ("up_block_types", "UpDecoderBlock2D", decoder_levels),
    ):
        if key in config and list(config[key]) != [kind] * levels:
            problems.append(f"{key}={config[key]!r}")
    if decoder_levels != encoder_levels:  # the decoder would not undo the encoder's downscaling
        problems.append(f"{decoder_levels} decoder levels for {encoder_levels} encoder levels")
    groups = config.get("norm_num_groups", VAEConfig.norm_num_groups)
    widths = (*(config.get("block_out_channels") or ()), *(config.get("decoder_block_out_channels") or ()))
    odd = sorted({width for width in widths if width % groups})
    if odd:
        problems.append(f"widths {odd} with norm_num_groups={groups} (a GroupNorm needs multiples of it)")
    if problems:
        raise CheckpointError(f"VAE config: unsupported {', '.join(problems)}")


def _conv(cin: int, cout: int, size: int, *, rngs, param_dtype, strides=1, padding="SAME") -> nnx.Conv:
    return nnx.Conv(cin, cout, (size, size), strides, padding=padding, rngs=rngs, param_dtype=param_dtype)


def _group_norm(channels: int, groups: int, *, rngs, param_dtype) -> GroupNorm:
    return GroupNorm(
        channels, groups, epsilon=_NORM_EPS, use_fast_variance=False, rngs=rngs, param_dtype=param_dtype
    )


class GroupNorm(nnx.GroupNorm):
    """Flax's GroupNorm (same parameters, same result) with its statistics from one read of the activations.

    Flax's exact variance reads the activations twice; its one-pass E[x^2] - E[x]^2 loses digits when a
    group's mean is large against its spread. Here: per-channel sums over the pixels (vectorised),
    shifted by the channel's first pixel s, which lies within a few standard deviations of the mean, so
    the cancellation costs a few bits at most; groups then combine their channels exactly (law of total
    variance), and the normalisation and affine fold into one per-channel scale and offset.
    """

    def __call__(self, x: jax.Array) -> jax.Array:
        """float[B, Y, X, C] -> float[B, Y, X, C], statistics per image and group of C / groups channels."""
        b, c, g = x.shape[0], x.shape[-1], self.num_groups
        dtype = jnp.result_type(x, self.scale[...])
        pixels = x.reshape(b, -1, c).astype(jnp.float32)
        first = pixels[:, :1]  # on a canvas too: its top-left pixel is the image's
        centred = pixels - first
        real = vae_canvas.weights(x)  # None, or the image's pixels on a canvas: the statistics are theirs
        if real is None:
            mean, square = jnp.mean(centred, axis=1), jnp.mean(centred * centred, axis=1)  # [B, C]
        else:
            count = jnp.sum(real)
            mean, square = (jnp.sum(v * real, axis=1) / count for v in (centred, centred * centred))
        channel_mean = (first[:, 0] + mean).reshape(b, g, c // g)
        channel_var = jnp.maximum(square - mean * mean, 0.0).reshape(b, g, c // g)
        group_mean = jnp.mean(channel_mean, axis=-1, keepdims=True)
        group_var = jnp.mean(channel_var + (channel_mean - group_mean) ** 2, axis=-1, keepdims=True)
        gain = jax.lax.rsqrt(group_var + self.epsilon) * self.scale[...].reshape(g, c // g)
        offset = self.bias[...].reshape(g, c // g) - group_mean * gain
        y = pixels * gain.reshape(b, 1, c) + offset.reshape(b, 1, c)
        return y.reshape(x.shape).astype(dtype)


class ResnetBlock(nnx.Module):
    """GroupNorm -> SiLU -> 3x3 conv, twice, plus a (1x1-projected if widths differ) skip."""

    def __init__(self, cin: int, cout: int, groups: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.norm1 = _group_norm(cin, groups, **kw)
        self.conv1 = _conv(cin, cout, 3, **kw)
        self.norm2 = _group_norm(cout, groups, **kw)
        self.conv2 = _conv(cout, cout, 3, **kw)
        self.conv_shortcut = _conv(cin, cout, 1, **kw) if cin != cout else None

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.conv1(vae_canvas.zeroed(transcendentals.silu(self.norm1(x))))
        h = self.conv2(vae_canvas.zeroed(transcendentals.silu(self.norm2(h))))
        skip = self.conv_shortcut(x) if self.conv_shortcut is not None else x
        return skip + h


class Downsample(nnx.Module):
    """Stride-2 3x3 conv, padded only at the bottom / right (diffusers' `downsample_padding=0`)."""

    def __init__(self, channels: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.conv = _conv(
            channels, channels, 3, strides=2, padding=((0, 1), (0, 1)), rngs=rngs, param_dtype=param_dtype
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.conv(vae_canvas.zeroed(x))


# Nearest-neighbour 2x upsampling then a 3x3 conv, per output parity: output row 2i reads upsampled
# rows 2i-1, 2i, 2i+1 = input rows i-1, i, i (taps W0 and W1 + W2); row 2i+1 reads input rows i, i, i+1
# (taps W0 + W1 and W2). _PHASE_TAPS[parity] maps the 3 taps onto those 2; the same holds for columns.
_PHASE_TAPS = (((1, 0, 0), (0, 1, 1)), ((1, 1, 0), (0, 0, 1)))


def _phase_kernel(weights: jax.Array) -> jax.Array:
    """float32 kernel[p, q, i, (row parity a, column parity b, o)] of a 2x2 VALID conv over the padded
    input, from the 3x3 conv's `weights` [y, x, i, o]: each entry the sum of the taps `_PHASE_TAPS`
    maps onto it, added in float32 (bf16 weights are rounded once, not once per tap). Added, not
    multiplied by the 0/1 taps: XLA makes such an einsum a GEMM over a float32 copy of the weight; these
    sums are one elementwise fusion."""
    wide = weights.astype(jnp.float32)

    def tap(a: int, p: int, b: int, q: int) -> jax.Array:  # [i, o]
        rows, columns = _PHASE_TAPS[a][p], _PHASE_TAPS[b][q]
        return sum(wide[y, x] for y in range(3) if rows[y] for x in range(3) if columns[x])

    def parities(p: int, q: int) -> jax.Array:  # [i, a, b, o]
        return jnp.stack([jnp.stack([tap(a, p, b, q) for b in (0, 1)], 1) for a in (0, 1)], 1)

    return jnp.stack([jnp.stack([parities(p, q) for q in (0, 1)]) for p in (0, 1)])


class Upsample(nnx.Module):
    """Nearest-neighbour 2x upsampling, then a 3x3 conv, computed on the low-resolution input.

    Exactly the same sums (weights added first): each output parity (row, column) is a 2x2 conv of
    the input, all four in one conv with 4 x C outputs, then depth-to-space. 16 instead of 36
    multiply-adds per input pixel and channel pair, and the 4x upsampled input is never built.
    """

    def __init__(self, channels: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.conv = _conv(channels, channels, 3, rngs=rngs, param_dtype=param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """float[B, y, x, C] -> float[B, 2y, 2x, C]."""
        b, h, w, c = x.shape
        weights = self.conv.kernel[...]
        dtype = jnp.result_type(x, weights)
        kernel = _phase_kernel(weights).astype(dtype)
        padded = jnp.pad(vae_canvas.zeroed(x).astype(dtype), ((0, 0), (1, 1), (1, 1), (0, 0)))
        out = jax.lax.conv_general_dilated(
            padded,
            kernel.reshape(2, 2, c, 4 * c),
            (1, 1),
            "VALID",
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        ).reshape(b, h + 1, w + 1, 2, 2, c)
        # Output pixel (2i + a, 2j + b) is parity (a, b) at window position (i + a, j + b).
        rows = [jnp.stack([out[:, a : a + h, bb : bb + w, a, bb] for bb in (0, 1)], axis=3) for a in (0, 1)]
        out = jnp.stack(rows, axis=2).reshape(b, 2 * h, 2 * w, c)
        return out + self.conv.bias[...].astype(dtype)


class Attention(nnx.Module):
    """Single-head self-attention over every position of its input, GroupNorm first, residual added."""

    def __init__(self, channels: int, groups: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.group_norm = _group_norm(channels, groups, **kw)
        self.to_q, self.to_k, self.to_v = (nnx.Linear(channels, channels, **kw) for _ in range(3))
        # A list, as in diffusers (whose to_out.1 is a dropout), so the checkpoint key is to_out.0.
        self.to_out = nnx.List([nnx.Linear(channels, channels, **kw)])

    def __call__(self, x: jax.Array) -> jax.Array:
        b, h, w, c = x.shape
        tokens = self.group_norm(x).reshape(b, h * w, c)
        q, k, v = (p(tokens)[:, :, None] for p in (self.to_q, self.to_k, self.to_v))  # one head
        out = attend(q, k, v, Keys(rank=vae_canvas.key_rank(x)))[:, :, 0]
        return x + self.to_out[0](out).reshape(x.shape)


class MidBlock(nnx.Module):
    """ResNet -> attention -> ResNet at the lowest resolution."""

    def __init__(
        self, channels: int, groups: int, attention: bool, *, rngs: nnx.Rngs, param_dtype=jnp.float32
    ):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.resnets = nnx.List([ResnetBlock(channels, channels, groups, **kw) for _ in range(2)])
        self.attentions = nnx.List([Attention(channels, groups, **kw)] if attention else [])

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.resnets[0](x)
        for block in self.attentions:
            x = block(x)
        return self.resnets[1](x)


class LevelBlock(nnx.Module):
    """ResNets at one resolution, then (except at the last level) a resampler, under diffusers' key:
    `downsamplers` (the encoder's `Downsample`) or `upsamplers` (the decoder's `Upsample`)."""

    def __init__(
        self, cin, cout, layers, groups, sampler, key: str, resample: bool, *, rngs, param_dtype=jnp.float32
    ):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.resnets = nnx.List(
            [ResnetBlock(cin if i == 0 else cout, cout, groups, **kw) for i in range(layers)]
        )
        self.key = key
        setattr(self, key, nnx.List([sampler(cout, **kw)]) if resample else None)

    def __call__(self, x: jax.Array) -> jax.Array:
        for module in (*self.resnets, *(getattr(self, self.key) or ())):
            x = module(x)
        return x


def _levels(widths, layers: int, groups: int, sampler, key: str, **kw) -> nnx.List:
    """A `LevelBlock` per width, each reading the one before's; all but the last resample."""
    ins, last = (widths[0], *widths[:-1]), len(widths) - 1
    return nnx.List(
        [LevelBlock(ins[i], widths[i], layers, groups, sampler, key, i < last, **kw) for i in range(last + 1)]
    )


class Encoder(nnx.Module):
    """float[B, Y, X, 3] images -> float[B, y, x, 2 * latent] (Gaussian mean, then log-variance)."""

    def __init__(self, cfg: VAEConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        widths, groups = cfg.block_out_channels, cfg.norm_num_groups
        self.conv_in = _conv(cfg.in_channels, widths[0], 3, **kw)
        self.down_blocks = _levels(widths, cfg.layers_per_block, groups, Downsample, "downsamplers", **kw)
        self.mid_block = MidBlock(widths[-1], groups, cfg.mid_block_add_attention, **kw)
        self.conv_norm_out = _group_norm(widths[-1], groups, **kw)
        self.conv_out = _conv(widths[-1], 2 * cfg.latent_channels, 3, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        x = self.mid_block(x)
        return self.conv_out(vae_canvas.zeroed(transcendentals.silu(self.conv_norm_out(x))))


class Decoder(nnx.Module):
    """float[B, y, x, latent] -> float[B, Y, X, 3] images."""

    def __init__(self, cfg: VAEConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        widths, groups = tuple(reversed(cfg.decoder_channels)), cfg.norm_num_groups
        self.conv_in = _conv(cfg.latent_channels, widths[0], 3, **kw)
        self.mid_block = MidBlock(widths[0], groups, cfg.mid_block_add_attention, **kw)
        self.up_blocks = _levels(widths, cfg.layers_per_block + 1, groups, Upsample, "upsamplers", **kw)
        self.conv_norm_out = _group_norm(widths[-1], groups, **kw)
        self.conv_out = _conv(widths[-1], cfg.out_channels, 3, **kw)

    def __call__(self, z: jax.Array) -> jax.Array:
        x = self.mid_block(self.conv_in(vae_canvas.zeroed(z)))
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(vae_canvas.zeroed(transcendentals.silu(self.conv_norm_out(x))))


class LatentNorm(nnx.Module):
    """The running statistics of diffusers' affine-free BatchNorm over the 128 patchified channels."""

    def __init__(self, channels: int, eps: float):
        self.running_mean = nnx.BatchStat(jnp.zeros((channels,), jnp.float32))
        self.running_var = nnx.BatchStat(jnp.ones((channels,), jnp.float32))
        self.eps = eps

    def std(self) -> jax.Array:
        return jnp.sqrt(self.running_var[...].astype(jnp.float32) + self.eps)


class AutoencoderKLFlux2(nnx.Module):
    """Encoder, decoder, the 1x1 (post-)quant convs and the latent BatchNorm statistics."""

    def __init__(self, cfg: VAEConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        latent = cfg.latent_channels
        self.config = cfg
        self.encoder = Encoder(cfg, **kw)
        self.decoder = Decoder(cfg, **kw)
        self.quant_conv = _conv(2 * latent, 2 * latent, 1, **kw) if cfg.use_quant_conv else None
        self.post_quant_conv = _conv(latent, latent, 1, **kw) if cfg.use_post_quant_conv else None
        self.bn = LatentNorm(_PATCH * _PATCH * latent, cfg.batch_norm_eps)

    def encode_mean(self, images: jax.Array) -> jax.Array:
        """float[B, Y, X, 3] -> float[B, y, x, latent], the mode of the latent distribution."""
        moments = self.encoder(images)
        if self.quant_conv is not None:
            moments = self.quant_conv(moments)
        return moments[..., : self.config.latent_channels]

    def decode(self, z: jax.Array) -> jax.Array:
        """float[B, y, x, latent] -> float[B, Y, X, 3]."""
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z)
        return self.decoder(z)


def patchify(z: jax.Array) -> jax.Array:
    """float[B, y, x, C] -> float[B, y/2, x/2, 4C], channel `4 * c + 2 * dy + dx` (diffusers' order)."""
    return rearrange(z, "b (h ph) (w pw) c -> b h w (c ph pw)", ph=_PATCH, pw=_PATCH)


def unpatchify(x: jax.Array) -> jax.Array:
    """Inverse of `patchify`: float[B, y/2, x/2, 4C] -> float[B, y, x, C]."""
    return rearrange(x, "b h w (c ph pw) -> b (h ph) (w pw) c", ph=_PATCH, pw=_PATCH)


def encode_latents(vae: AutoencoderKLFlux2, images: jax.Array) -> jax.Array:
    """float[B, Y, X, 3] images in [-1, 1] -> float[B, Y/16, X/16, 128] normalised latents."""
    tokens = patchify(vae.encode_mean(images))
    mean = vae.bn.running_mean[...].astype(jnp.float32)
    return ((tokens - mean) / vae.bn.std()).astype(tokens.dtype)


def decode_latents(vae: AutoencoderKLFlux2, latents: jax.Array) -> jax.Array:
    """float[B, Y/16, X/16, 128] normalised latents -> float[B, Y, X, 3] images (about [-1, 1])."""
    return vae.decode(vae_latents(vae, latents))


def vae_latents(vae: AutoencoderKLFlux2, latents: jax.Array) -> jax.Array:
    """float[B, Y/16, X/16, 128] normalised latents -> float[B, Y/8, X/8, C] the decoder's input (what
    diffusers returns for output_type="latent", there channels first)."""
    mean = vae.bn.running_mean[...].astype(jnp.float32)
    return unpatchify((latents * vae.bn.std() + mean).astype(latents.dtype))


def encode_latents_on_canvas(vae: AutoencoderKLFlux2, images: jax.Array, extent) -> jax.Array:
    """`encode_latents` of images of `extent` (int32[2]: height, width px) at the top left of `images`
    float[B, Y, X, 3], zeros beyond (`klein.models.vae_canvas`): their latents at the top left of the
    output, anything beyond."""
    with vae_canvas.on_canvas(extent, images.shape[1]):
        return encode_latents(vae, images)


def decode_latents_on_canvas(vae: AutoencoderKLFlux2, latents: jax.Array, extent) -> jax.Array:
    """`decode_latents` of latents of an image of `extent` (int32[2]: height, width px) at the top left of
    `latents` float[B, Y/16, X/16, 128]: its pixels at the top left of the output, anything beyond."""
    with vae_canvas.on_canvas(extent, latents.shape[1] * vae.config.pixels_per_token):
        return decode_latents(vae, latents)
