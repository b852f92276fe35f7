"""Loading the FLUX.2 VAE into Flax NNX: from a diffusers `vae/` folder (config.json + safetensors), or from
one single file in BFL or diffusers naming."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from klein.errors import CheckpointError
from klein.io import bfl_vae_keys
from klein.io.json_file import read_json
from klein.io.loading import expected_shapes, load_module
from klein.io.mapped import MappedSource
from klein.io.safetensors import TensorSource
from klein.models.vae import AutoencoderKLFlux2, VAEConfig

# BatchNorm's training-step counter: saved by torch, meaningless for inference.
SKIPPED_KEYS = frozenset({"bn.num_batches_tracked"})
# One key that each naming of a single-file VAE has.
_BFL_MARKER = "encoder.down.0.block.0.conv1.weight"
_DIFFUSERS_MARKER = "encoder.down_blocks.0.resnets.0.conv1.weight"


def load_vae(folder: str | Path, dtype=jnp.float32, *, place=None) -> AutoencoderKLFlux2:
    """Read `<folder>/config.json` and `<folder>/diffusion_pytorch_model*.safetensors`, strictly. The
    BatchNorm running statistics stay fp32 (in bf16 their 3 significant digits would shift every latent)."""
    folder = Path(folder)
    cfg = read_config(folder / "config.json")
    return _load(cfg, TensorSource.from_folder(folder, "diffusion_pytorch_model"), dtype, place)


def load_vae_file(
    path: str | Path, dtype=jnp.float32, *, place=None, config: VAEConfig | None = None
) -> AutoencoderKLFlux2:
    """A VAE saved as one safetensors file without a config, in BFL's names (`ae.safetensors`) or diffusers';
    `config` defaults to the released FLUX.2 VAE, the one every klein variant uses."""
    path = Path(path)
    cfg = config or VAEConfig.flux2()
    source = TensorSource.from_file(path)
    if _BFL_MARKER in source.keys():
        levels = len(cfg.decoder_channels)
        table = {key: bfl_vae_keys.piece(key, levels) for key in expected_shapes(abstract_vae(cfg))}
        source = MappedSource(source, table)
    elif _DIFFUSERS_MARKER not in source.keys():
        raise CheckpointError(
            f"{path}: not a FLUX.2 VAE: it has neither '{_BFL_MARKER}' (BFL names) nor '{_DIFFUSERS_MARKER}' "
            f"(diffusers names); is it a transformer or a text encoder?"
        )
    return _load(cfg, source, dtype, place)


def abstract_vae(cfg: VAEConfig) -> AutoencoderKLFlux2:
    """The VAE's parameter shapes, allocating nothing."""
    return nnx.eval_shape(lambda: AutoencoderKLFlux2(cfg, rngs=nnx.Rngs(0)))


def _load(cfg: VAEConfig, source, dtype, place) -> AutoencoderKLFlux2:
    vae = load_module(
        abstract_vae(cfg), source, dtype=jnp.float32, skip=SKIPPED_KEYS.__contains__, place=place
    )
    params = nnx.state(vae, nnx.Param)
    nnx.update(vae, jax.tree.map(lambda p: p.astype(dtype), params))
    return vae


def read_config(path: Path) -> VAEConfig:
    """The VAEConfig of a diffusers `vae/config.json`."""
    raw = read_json(path, "the VAE config")
    try:
        return VAEConfig.from_diffusers_config(raw)
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
