"""Loading the FLUX.2 VAE into Flax NNX: from a diffusers `vae/` folder (config.json + safetensors), from
one single file in BFL or diffusers naming, or from a decoder alone (FLUX.2-small-decoder's
`small_decoder.safetensors`, BFL's decoder keys without their `decoder.` prefix) completed by the encoder and
latent statistics of another VAE, the model's own.

A single file has no config: its widths per level, the encoder's and the decoder's apart (the small
decoder's are [96, 192, 384, 384] under the encoder's [128, 256, 512, 512]), are read from the shape of
each level's first convolution; the rest is FLUX.2's (or the completing VAE's).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from klein.errors import CheckpointError
from klein.io import bfl_vae_keys
from klein.io.json_file import read_json
from klein.io.loading import expected_shapes, load_module
from klein.io.mapped import Joined, MappedSource
from klein.io.safetensors import TensorSource
from klein.models.abstract_keys import AbstractKeys
from klein.models.vae import AutoencoderKLFlux2, VAEConfig

SMALL_DECODER = "https://huggingface.co/black-forest-labs/FLUX.2-small-decoder"
"""Where FLUX.2-small-decoder's files are published (full_encoder_small_decoder.safetensors,
small_decoder.safetensors)."""

# BatchNorm's training-step counter: saved by torch, meaningless for inference.
SKIPPED_KEYS = frozenset({"bn.num_batches_tracked"})


@dataclasses.dataclass(frozen=True)
class _Naming:
    """One naming of a single-file VAE: the keys of the first convolution of encoder and decoder level {}."""

    name: str
    encoder: str | None
    """None: files of this naming hold a decoder only."""
    decoder: str
    lowest_first: bool
    """Whether the decoder's levels count from the lowest resolution (diffusers') or the full one (BFL's)."""


_BFL = _Naming("BFL", "encoder.down.{}.block.0.conv1.weight", "decoder.up.{}.block.0.conv1.weight", False)
_DIFFUSERS = _Naming(
    "diffusers",
    "encoder.down_blocks.{}.resnets.0.conv1.weight",
    "decoder.up_blocks.{}.resnets.0.conv1.weight",
    True,
)
_BARE_DECODER = _Naming("BFL decoder-only", None, "up.{}.block.0.conv1.weight", False)
_NAMINGS = (_BFL, _DIFFUSERS, _BARE_DECODER)


def load_vae(folder: str | Path, dtype=jnp.float32, *, place=None) -> AutoencoderKLFlux2:
    """Read `<folder>/config.json` and `<folder>/diffusion_pytorch_model*.safetensors`, strictly. The
    BatchNorm running statistics stay fp32 (in bf16 their 3 significant digits would shift every latent)."""
    folder = Path(folder)
    cfg = read_config(folder / "config.json")
    return _load(cfg, TensorSource.from_folder(folder, "diffusion_pytorch_model"), dtype, place)


def load_vae_file(path: str | Path, dtype=jnp.float32, *, place=None, own: Path | None = None):
    """A VAE saved as one safetensors file without a config: a whole one in BFL's names (`ae.safetensors`,
    `full_encoder_small_decoder.safetensors`) or diffusers', or a decoder alone (`small_decoder.safetensors`)
    completed by `own`; its widths from the file, the rest from `own` (`vae_config`)."""
    return _load(*_opened(Path(path), own), dtype, place)


def vae_config(path: str | Path, own: Path | None = None) -> VAEConfig:
    """The config of the VAE at `path` (what `load_vae` or `load_vae_file` loads), read from configs and
    headers only. A single file's widths are its own; the rest comes from `own`, the model's own VAE (a
    folder or a whole file; default: FLUX.2's config), which also completes a decoder-only file with its
    encoder and latent statistics."""
    return _opened(Path(path), own)[0]


def file_config(path: str | Path, base: VAEConfig) -> VAEConfig:
    """The config of the single-file VAE at `path`: its widths from the file; the rest, and a decoder-only
    file's encoder widths, from `base` (for a plan, which knows the model's own VAE by its config alone)."""
    path = Path(path)
    source = TensorSource.from_file(path)
    naming = _naming(path, source)
    if _holds_encoder(source, naming):
        return _configured(path, base, _widths(source, naming, encoder=True), _widths(source, naming))
    return _configured(path, base, base.block_out_channels, _widths(source, naming))


def abstract_vae(cfg: VAEConfig) -> AutoencoderKLFlux2:
    """The VAE's parameter shapes, allocating nothing: a module of its own for each caller (loading fills
    it), merged from shapes traced once per config."""
    return nnx.merge(*_abstract_vae(cfg))


@functools.cache
def _abstract_vae(cfg: VAEConfig):
    return nnx.split(nnx.eval_shape(lambda: AutoencoderKLFlux2(cfg, rngs=AbstractKeys())))


def read_config(path: Path) -> VAEConfig:
    """The VAEConfig of a diffusers `vae/config.json`."""
    raw = read_json(path, "the VAE config")
    try:
        return VAEConfig.from_diffusers_config(raw)
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}") from None


def _load(cfg: VAEConfig, source, dtype, place) -> AutoencoderKLFlux2:
    vae = load_module(
        abstract_vae(cfg), source, dtype=jnp.float32, skip=SKIPPED_KEYS.__contains__, place=place
    )
    params = nnx.state(vae, nnx.Param)
    nnx.update(vae, jax.tree.map(lambda p: p.astype(dtype), params))
    return vae


def _opened(path: Path, own: Path | None) -> tuple[VAEConfig, object]:
    """(config, tensors under diffusers' names) of the VAE at `path` (`vae_config`)."""
    if path.is_dir():
        return read_config(path / "config.json"), TensorSource.from_folder(path, "diffusion_pytorch_model")
    source = TensorSource.from_file(path)
    naming = _naming(path, source)
    whole = _holds_encoder(source, naming)
    if not whole and own is None:
        raise CheckpointError(
            f"{path}: a VAE decoder alone (as FLUX.2-small-decoder's small_decoder.safetensors), whose encoder "
            "and latent statistics come from the model's own VAE: name the model too (--model), or give a file "
            f"holding both (full_encoder_small_decoder.safetensors, from {SMALL_DECODER})"
        )
    base, rest = _opened(own, None) if own is not None else (VAEConfig.flux2(), None)
    cfg = file_config(path, base)
    if naming is not _DIFFUSERS:
        levels, bare = len(cfg.decoder_channels), naming is _BARE_DECODER
        table = {key: bfl_vae_keys.piece(key, levels, bare) for key in expected_shapes(abstract_vae(cfg))}
        source = MappedSource(source, table)
    if whole:
        return cfg, source
    return cfg, Joined([(source, lambda key: True), (rest, lambda key: not _in_decoder(key))])


def _naming(path: Path, source: TensorSource) -> _Naming:
    keys = source.keys()
    for naming in _NAMINGS:
        if naming.decoder.format(0) in keys:
            return naming
    markers = " or ".join(f"'{n.decoder.format(0)}' ({n.name} names)" for n in _NAMINGS)
    raise CheckpointError(
        f"{path}: not a FLUX.2 VAE: it has none of {markers}; is it a transformer or a text encoder?"
    )


def _holds_encoder(source: TensorSource, naming: _Naming) -> bool:
    return naming.encoder is not None and naming.encoder.format(0) in source.keys()


def _widths(source: TensorSource, naming: _Naming, encoder: bool = False) -> tuple[int, ...]:
    """Channels per level, full resolution first: the output channels of each level's first convolution."""
    pattern, keys = naming.encoder if encoder else naming.decoder, source.keys()
    widths = []
    while pattern.format(len(widths)) in keys:
        widths.append(source.shape(pattern.format(len(widths)))[0])
    return tuple(widths[::-1] if naming.lowest_first and not encoder else widths)


def _configured(path: Path, base: VAEConfig, encoder: tuple, decoder: tuple) -> VAEConfig:
    """`base` with these widths, checked as a config.json would be."""
    fields = dataclasses.asdict(base) | dict(block_out_channels=encoder, decoder_block_out_channels=decoder)
    if decoder == encoder:
        fields["decoder_block_out_channels"] = None
    try:
        return VAEConfig.from_diffusers_config(fields)
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}") from None


def _in_decoder(key: str) -> bool:
    """Whether diffusers key `key` is the decoder's (BFL's decoder holds the post-quant conv)."""
    return key.startswith(("decoder.", "post_quant_conv."))
