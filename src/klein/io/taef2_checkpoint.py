"""Loading TAEF2's decoder (`klein.models.taef2`) from its published safetensors files, in any of the
three layouts they come in:

- the decoder alone, as the reference's `nn.Sequential` names it (`taef2_decoder.safetensors`, ComfyUI's
  `models/vae_approx/` file): `1.weight`, `3.conv.0.weight`, `3.pool.1.weight`, ..., `19.bias`;
- a whole reference `TAESD` module's state: the same under `decoder.` (and an `encoder.` beside it);
- diffusers' `AutoencoderTiny` layout (`taef2.safetensors` on huggingface.co/madebyollin/taef2):
  `decoder.layers.{i - 1}.` for the reference's layer i (diffusers' decoder drops the leading clamp),
  beside `encoder.layers.`.

The encoder's weights, where a file has them, are not read.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
from flax import nnx

from klein.errors import CheckpointError, InputError
from klein.io.loading import load_module
from klein.io.paths import klein_home
from klein.io.safetensors import TensorSource
from klein.models.abstract_keys import AbstractKeys
from klein.models.taef2 import LEVEL_BLOCKS, TAEF2Decoder

DOWNLOAD = "https://huggingface.co/madebyollin/taef2/resolve/main/taef2.safetensors"
"""Where the weights are published (MIT licence), in diffusers' layout."""
DEFAULT_NAME = "taef2.safetensors"
"""The file's name under klein's folder (`default_path`)."""

# The reference decoder's layer index of each weighted NNX layer: ReLUs, upsamplings and the clamp hold no
# weights, so its indices skip them (0 clamp, 2 ReLU, 6/11/16 upsampling).
_CONV_IN, _CONV_OUT = 1, 19
_BLOCKS = (3, 4, 5, 8, 9, 10, 13, 14, 15, 18)
_UPS = (7, 12, 17)
_BLOCK_PARTS = {"convs.0": "conv.0", "convs.1": "conv.2", "convs.2": "conv.4", "pool.expand": "pool.0"}
_BLOCK_PARTS |= {"pool.norm": "pool.1", "pool.project": "pool.3"}
assert len(_BLOCKS) == sum(LEVEL_BLOCKS) and len(_UPS) == len(LEVEL_BLOCKS) - 1


def default_path() -> Path:
    """Where `preview=True` looks for the weights: `$KLEIN_HOME/taef2.safetensors`."""
    return klein_home() / DEFAULT_NAME


def missing_message(path: Path) -> str:
    """What to do when the weights are not at `path`."""
    return (
        f"previews need TAEF2's decoder weights, and {path} does not exist: download {DOWNLOAD} "
        f"to {default_path()}, or pass the path of a TAEF2 safetensors file (taef2.safetensors "
        f"or taef2_decoder.safetensors)"
    )


def reference_key(dotted: str) -> str:
    """The reference decoder's key of one of `TAEF2Decoder`'s parameters, named as `klein.io.loading`
    names it (`blocks.0.pool.norm.weight` -> `3.pool.1.weight`)."""
    head, _, rest = dotted.partition(".")
    if head in ("conv_in", "conv_out"):
        return f"{_CONV_IN if head == 'conv_in' else _CONV_OUT}.{rest}"
    index, _, rest = rest.partition(".")
    if head == "ups":
        return f"{_UPS[int(index)]}.{rest}"
    part, _, leaf = rest.rpartition(".")
    return f"{_BLOCKS[int(index)]}.{_BLOCK_PARTS[part]}.{leaf}"


def _diffusers_key(key: str) -> str:
    index, _, rest = key.partition(".")
    return f"decoder.layers.{int(index) - 1}.{rest}"


# (key the layout is recognised by, its key of a reference key, keys it holds that are not the decoder's)
_LAYOUTS = (
    ("1.weight", lambda key: key, lambda key: False),
    ("decoder.1.weight", lambda key: "decoder." + key, lambda key: key.startswith("encoder.")),
    ("decoder.layers.0.weight", _diffusers_key, lambda key: key.startswith("encoder.")),
)


def load_taef2(path: str | Path, dtype=jnp.float32, *, latent_channels: int | None = None) -> TAEF2Decoder:
    """TAEF2's decoder from the safetensors file at `path`, strictly (every key used, every shape right);
    `latent_channels`: those the pipeline's latents have, checked against the file's."""
    path = Path(path)
    if not path.is_file():
        raise InputError(missing_message(path))
    source = TensorSource.from_file(path)
    keys = source.keys()
    layout = next((layout for layout in _LAYOUTS if layout[0] in keys), None)
    if layout is None:
        raise CheckpointError(
            f"{path}: not a TAEF2 decoder: it has none of the keys "
            f"{', '.join(repr(marker) for marker, _, _ in _LAYOUTS)}; is it a VAE or a transformer?"
        )
    marker, name, skip = layout
    if name(reference_key("blocks.0.pool.expand.weight")) not in keys:
        raise CheckpointError(
            f"{path}: a tiny autoencoder without TAEF2's GroupNorm branch (no "
            f"'{name('3.pool.0.weight')}'): TAESD or TAEF1, for other models' latents; use TAEF2's weights, "
            f"{DOWNLOAD}"
        )
    channels = source.shape(marker)[1] if len(source.shape(marker)) == 4 else None
    if channels is None or (latent_channels is not None and channels != latent_channels):
        raise CheckpointError(
            f"{path}: a decoder of {channels} latent channels; this pipeline's latents have "
            f"{latent_channels} (FLUX.2's 32): is it TAEF2's?"
        )
    abstract = nnx.eval_shape(lambda: TAEF2Decoder(channels, rngs=AbstractKeys()))
    return load_module(abstract, source, dtype=dtype, key_map=lambda key: name(reference_key(key)), skip=skip)
