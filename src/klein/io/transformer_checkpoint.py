"""Loading the FLUX.2 transformer from a diffusers `transformer/` folder."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
from flax import nnx

from klein.io.json_file import read_json
from klein.io.loading import expected_shapes, load_module
from klein.io.safetensors import TensorSource
from klein.models.transformer import Flux2Transformer
from klein.models.transformer_config import TransformerConfig

STACKED = ("transformer_blocks", "single_transformer_blocks")


def key_map(key: str) -> str:
    # Double blocks keep diffusers' `to_out` ModuleList (Linear, Dropout); single blocks have a plain Linear.
    if key.startswith("transformer_blocks."):
        return key.replace(".attn.to_out.", ".attn.to_out.0.")
    return key


def abstract_transformer(cfg: TransformerConfig, dtype=jnp.float32) -> Flux2Transformer:
    return nnx.eval_shape(lambda: Flux2Transformer(cfg, rngs=nnx.Rngs(0), dtype=dtype))


def expected_transformer_keys(cfg: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint keys and PyTorch-layout shapes a transformer with this config must have."""
    return expected_shapes(abstract_transformer(cfg), STACKED, key_map)


def read_config(folder: str | Path) -> TransformerConfig:
    """The transformer config of a diffusers-layout transformer folder (`config.json`)."""
    return TransformerConfig.from_diffusers(read_json(Path(folder) / "config.json", "transformer config"))


def load_transformer(folder: str | Path, dtype=jnp.float32, *, place=None) -> Flux2Transformer:
    """Strictly load `<folder>/config.json` and its safetensors (single file or sharded)."""
    folder = Path(folder)
    cfg = read_config(folder)
    source = TensorSource.from_folder(folder, "diffusion_pytorch_model")
    abstract = abstract_transformer(cfg, dtype)
    return load_module(abstract, source, dtype=dtype, stacked=STACKED, key_map=key_map, place=place)
