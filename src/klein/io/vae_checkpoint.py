"""Loading the FLUX.2 VAE from a diffusers `vae/` folder (config.json + safetensors) into Flax NNX."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from klein.errors import CheckpointError
from klein.io.loading import load_module
from klein.io.safetensors import TensorSource
from klein.models.vae import AutoencoderKLFlux2, VAEConfig

# BatchNorm's training-step counter: saved by torch, meaningless for inference.
SKIPPED_KEYS = frozenset({"bn.num_batches_tracked"})


def load_vae(folder: str | Path, dtype=jnp.float32, place=None) -> tuple[VAEConfig, AutoencoderKLFlux2]:
    """Read `<folder>/config.json` and `<folder>/diffusion_pytorch_model*.safetensors`, strictly.

    Weights are cast to `dtype`; the BatchNorm running statistics stay fp32, since in bf16 their
    3 significant digits would shift every latent. `place` is `load_module`'s.
    """
    folder = Path(folder)
    cfg = read_config(folder / "config.json")
    source = TensorSource.from_folder(folder, "diffusion_pytorch_model")
    abstract = nnx.eval_shape(lambda: AutoencoderKLFlux2(cfg, rngs=nnx.Rngs(0)))
    vae = load_module(abstract, source, dtype=jnp.float32, skip=SKIPPED_KEYS.__contains__, place=place)
    params = nnx.state(vae, nnx.Param)
    nnx.update(vae, jax.tree.map(lambda p: p.astype(dtype), params))
    return cfg, vae


def read_config(path: Path) -> VAEConfig:
    """The VAEConfig of a diffusers `vae/config.json`."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a readable VAE config ({exc})") from None
    try:
        return VAEConfig.from_diffusers_config(raw)
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
