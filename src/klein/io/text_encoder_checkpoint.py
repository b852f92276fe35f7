"""Loading the Qwen3 text encoder from a diffusers `text_encoder/` folder: only the decoder layers the prompt
embedding reads; the later layers, the final norm and `lm_head` are skipped by name.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from klein.errors import CheckpointError, InputError, counted
from klein.io.json_file import read_json
from klein.io.loading import checkpoint_keys, expected_shapes, load_module
from klein.io.mapped import MappedSource, Whole
from klein.io.quantised import GgmlBlocks
from klein.io.safetensors import TensorSource
from klein.models import gguf_blocks
from klein.models.abstract_keys import AbstractKeys
from klein.models.layers import Linear, packed, store
from klein.models.qwen3 import PROMPT_LAYERS, Qwen3TextEncoder
from klein.models.qwen3_config import Qwen3Config

STACKED = ("model.layers",)
LOADED = max(PROMPT_LAYERS)
"""The decoder layers loaded: the first, up to the last whose hidden states the prompt embedding reads."""


BLOCKS = ("Q8_0", "Q4_0")
"""The ggml block types a text encoder's Linears may be quantised into at load (`load_text_encoder`)."""
TABLE = "model.embed_tokens.weight"
"""The token table's checkpoint key."""


def load_text_encoder(
    folder: str | Path, dtype=jnp.float32, *, place=None, blocks: str | None = None
) -> Qwen3TextEncoder:
    """Load the first `LOADED` decoder layers (and the embedding) of the text encoder in `folder`; `place`
    puts each weight on its device(s) (see `load_module`). `blocks` (one of `BLOCKS`): every Linear of the
    decoder layers quantised as it is read into ggml blocks of that type, and the token table left out
    (`Qwen3Model.table_on_host`: `read_table` reads it)."""
    folder = Path(folder)
    config = read_config(folder)
    source = TensorSource.from_folder(folder, "model")
    skipped = skipped_keys(config, LOADED)
    if blocks is not None:
        plan = checkpoint_keys(abstract_text_encoder(config, LOADED), STACKED)
        forms = quantised_forms(config, blocks)
        kernels = {key: GgmlBlocks(Whole(key), blocks) for path in forms for key in plan[(*path, "kernel")]}
        source, skipped = MappedSource(source, kernels), skipped | {TABLE}
    abstract = abstract_text_encoder(config, LOADED, dtype, quantised_forms(config, blocks), table=not blocks)
    return load_module(abstract, source, dtype=dtype, stacked=STACKED, skip=skipped.__contains__, place=place)


def quantised_forms(config: Qwen3Config, blocks: str | None) -> dict:
    """Module path -> stored form of the decoder layers' Linears quantised into ggml `blocks` at load (none
    for None)."""
    if blocks is None:
        return {}
    if blocks not in BLOCKS:
        raise ValueError(f"blocks must be one of {', '.join(BLOCKS)}, got {blocks!r}")
    abstract = abstract_text_encoder(config, 1)
    linears = {path: module for path, module in nnx.iter_modules(abstract) if isinstance(module, Linear)}
    values = gguf_blocks.sizes(blocks)[0]
    ragged = sorted({m.kernel.shape[-2] for m in linears.values() if m.kernel.shape[-2] % values})
    if ragged:
        raise InputError(
            f"--text-encoder-weights {blocks}: ggml blocks hold {values} inputs each, and this text encoder's "
            f"Linears take {', '.join(map(str, ragged))}; use --text-encoder-weights dtype (or auto)"
        )
    return {path: packed(blocks) for path in linears}


def read_table(folder: str | Path, dtype) -> np.ndarray:
    """The token table of the text encoder in `folder`, in host memory as `dtype`: what a prompt's rows are
    gathered from when the model leaves it out (`load_text_encoder(blocks=...)`)."""
    source = TensorSource.from_folder(Path(folder), "model")
    return np.ascontiguousarray(source.get(TABLE).astype(dtype, copy=False))


def read_config(folder: str | Path) -> Qwen3Config:
    """The `Qwen3Config` of `<folder>/config.json`, refused without the layers the prompt embedding reads."""
    config = Qwen3Config.from_hf_config(read_json(Path(folder) / "config.json", "the text encoder config"))
    check_layers(config, folder)
    return config


def check_layers(config: Qwen3Config, where) -> None:
    """Refuse a text encoder (at `where`, for the message) without the layers the embedding reads."""
    # transformers' hidden_states[num_hidden_layers] is the final norm's output, not a layer's: a layer read
    # must come before the last one. diffusers fails on fewer layers (an IndexError mid-request) and on
    # exactly max(layers) reads the normed output instead; klein refuses both before reading a weight.
    if LOADED >= config.num_hidden_layers:
        raise CheckpointError(
            f"{where}: the text encoder has {counted(config.num_hidden_layers, 'decoder layer')}; the "
            f"prompt embedding reads the hidden states after layers {', '.join(map(str, PROMPT_LAYERS))}, "
            f"so it needs at least {LOADED + 1}. Is this the Qwen3 text encoder of a klein checkpoint "
            f"(36 layers)?"
        )


def abstract_text_encoder(
    config: Qwen3Config,
    num_layers: int,
    dtype=jnp.float32,
    forms=None,
    embedding: str | None = None,
    table: bool = True,
) -> Qwen3TextEncoder:
    """The text encoder's parameter shapes, allocating nothing; its Linears stored as `forms` says (module
    path -> `klein.models.layers.Stored`), its token table as GGUF blocks of type `embedding` if named, or
    left out (`table` False: kept on the host)."""

    def build() -> Qwen3TextEncoder:
        encoder = store(Qwen3TextEncoder(config, num_layers, rngs=AbstractKeys(), dtype=dtype), forms or {})
        if embedding is not None:
            encoder.model.keep_blocks(embedding)
        if not table:
            encoder.model.table_on_host()
        return encoder

    return nnx.eval_shape(build)


def skipped_keys(config: Qwen3Config, num_layers: int) -> frozenset[str]:
    """Checkpoint keys deliberately not loaded: layers >= num_layers, `model.norm` and `lm_head`, named one
    by one so that a stray or misspelt key is still reported instead of being swallowed by a pattern."""
    layer_zero = "model.layers.0."
    one_layer = expected_shapes(abstract_text_encoder(config, 1), stacked=STACKED)
    per_layer = [k[len(layer_zero) :] for k in one_layer if k.startswith(layer_zero)]
    later = {
        f"model.layers.{i}.{name}" for i in range(num_layers, config.num_hidden_layers) for name in per_layer
    }
    return frozenset(later | {"model.norm.weight", "lm_head.weight"})
