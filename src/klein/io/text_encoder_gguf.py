"""Loading the Qwen3 text encoder from a GGUF file in llama.cpp's naming (as ComfyUI users download it),
mapped back with the `gguf` package's own table for `MODEL_ARCH.QWEN3`. Quantised Linears and embedding stay
as their blocks (docs/design/checkpoints.md, "Checkpoint layouts").
"""

from __future__ import annotations

import dataclasses
import math
import operator
from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np

from klein.errors import CheckpointError
from klein.io.block_forms import gguf_formats, kept_blocks, layer_piece
from klein.io.gguf_file import GGUFSource
from klein.io.gguf_header import Header, read_header
from klein.io.loading import checkpoint_keys, load_module
from klein.io.mapped import MappedSource, Viewed, Whole
from klein.io.text_encoder_checkpoint import (
    LOADED,
    STACKED,
    abstract_text_encoder,
    check_layers,
    skipped_keys,
)
from klein.models.layers import packed
from klein.models.qwen3 import Qwen3TextEncoder
from klein.models.qwen3_config import Qwen3Config

ARCH = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN3]
_EMBEDDING, _OUTPUT = "token_embd.weight", "output.weight"
_EMBEDDING_KEY = "model.embed_tokens.weight"
EMBEDDING = ("model", "embed_tokens")
"""The token embedding's module path."""
ROWS = 8192  # rows of a tensor widened at a time (Qwen3-8B embedding: 128 MiB of float32)


def load_text_encoder_gguf(
    path: str | Path, dtype=jnp.float32, *, place=None, dequantize: bool = False
) -> Qwen3TextEncoder:
    """The first `LOADED` decoder layers (and the embedding) of the Qwen3 GGUF at `path`; `place` as for
    `klein.io.text_encoder_checkpoint.load_text_encoder`; `dequantize` widens every weight to `dtype`."""
    config = read_gguf_config(path)
    source = GGUFSource(path)
    names = gguf_names(config)
    plan = checkpoint_keys(abstract_text_encoder(config, LOADED), STACKED)
    formats = gguf_formats(source.header)
    forms = {} if dequantize else _kept(plan, names, formats)
    embedding = forms.pop(EMBEDDING, None)
    as_blocks = {key: blocks for module, blocks in forms.items() for key in plan[(*module, "kernel")]}
    if embedding is not None:
        as_blocks[_EMBEDDING_KEY] = embedding
    table = {key: _piece(name, as_blocks.get(key), formats, dtype) for key, name in names.items()}
    abstract = abstract_text_encoder(
        config, LOADED, dtype, {m: packed(kind) for m, kind in forms.items()}, embedding
    )
    skip = skipped_keys(config, LOADED).__contains__
    return load_module(
        abstract, MappedSource(source, table), dtype=dtype, stacked=STACKED, skip=skip, place=place
    )


def kept_forms(path: str | Path, config: Qwen3Config) -> dict[tuple, str | tuple[str, ...]]:
    """Module path -> `blocks` of the Linears and token embedding (`EMBEDDING`) that `load_text_encoder_gguf`
    keeps as their blocks from the Qwen3 GGUF at `path`, read from its header alone (for the planner)."""
    header = qwen3_header(path)
    found, needed = _embedding(header), (config.vocab_size, config.hidden_size)
    if found != needed:
        raise CheckpointError(
            f"{path}: its token embedding is {found[0]} x {found[1]}, where this model's text encoder needs "
            f"{needed[0]} x {needed[1]}: a text encoder of another size (klein-4b takes Qwen3-4B, "
            f"klein-9b Qwen3-8B)"
        )
    plan = checkpoint_keys(abstract_text_encoder(config, LOADED), STACKED)
    return _kept(plan, gguf_names(config), gguf_formats(header))


def _kept(plan: dict[tuple, list[str]], names: dict[str, str], formats: dict[str, str]) -> dict:
    """The modules of `plan` (`checkpoint_keys`) a file of `formats` keeps as blocks
    (`klein.io.block_forms.kept_blocks`, by the file's `names`), and the embedding where it is quantised."""
    stored = {module: {names[key].removesuffix(".weight") for key in keys} for module, keys in plan.items()}
    embedding = formats.get(_EMBEDDING.removesuffix(".weight"))
    return kept_blocks(stored, formats) | ({EMBEDDING: embedding} if embedding else {})


def _piece(name: str, blocks, formats: dict[str, str], dtype):
    """Tensor `name` as its quantisation blocks (uint8 rows, widened inside the product) as a stack of
    format `blocks` holds them (`klein.io.block_forms.layer_piece`), else widened (`blocks` None)."""
    if blocks is None:
        return _Widened(name, np.dtype(dtype))
    return layer_piece(
        Viewed(Whole(name), operator.attrgetter("blocks")), blocks, formats[name.removesuffix(".weight")]
    )


@dataclasses.dataclass(frozen=True)
class _Widened(Whole):
    """A tensor dequantised `ROWS` rows at a time into `dtype`: Qwen3-8B's embedding widened whole in float32
    would take 2.5 GB, and gguf's dequantiser as much again, beside the 1.2 GB it keeps in bf16."""

    dtype: np.dtype = np.dtype(np.float32)

    def read(self, source) -> np.ndarray:
        shape = source.shape(self.key)
        out = np.empty(shape, self.dtype)
        for start in range(0, shape[0], ROWS):
            rows = slice(start, start + ROWS)
            out[rows] = source.get(self.key, rows)
        return out


def qwen3_header(path: str | Path) -> Header:
    """The header of the GGUF at `path`, refused unless it holds a Qwen3 model (`general.architecture`)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such GGUF file")
    header = read_header(path)
    arch = header.text(gguf.Keys.General.ARCHITECTURE)
    if arch != ARCH:
        held = f"a {arch!r} model" if arch else "no general.architecture"
        raise CheckpointError(
            f"{path}: holds {held}, not a Qwen3 text encoder; --text-encoder takes a Qwen3-4B or Qwen3-8B "
            f"GGUF in llama.cpp's naming (general.architecture = {ARCH!r}), or a Qwen3 folder"
        )
    return header


def read_gguf_config(path: str | Path) -> Qwen3Config:
    """The `Qwen3Config` of a Qwen3 GGUF's header, refused without the layers the prompt embedding reads."""
    header = qwen3_header(path)
    vocab_size = _embedding(header)[0]

    def field(name: str, read=header.integer, default=None, least: float = 1):
        """Metadata `name` (of this architecture) as `read` gives it, at least `least` (a size: positive)."""
        value = read(name.format(arch=ARCH), default)
        if value is None:
            raise CheckpointError(f"{path}: the GGUF metadata has no {name.format(arch=ARCH)!r}")
        if not least <= value < math.inf:
            raise CheckpointError(
                f"{path}: GGUF metadata {name.format(arch=ARCH)!r} is {value}; it must be "
                f"finite and at least {least}"
            )
        return value

    scaling = header.text(gguf.Keys.Rope.SCALING_TYPE.format(arch=ARCH), "none")
    if scaling != "none":
        raise CheckpointError(f"{path}: rope scaling {scaling!r} is not supported (Qwen3 has none)")
    hidden, heads = field(gguf.Keys.LLM.EMBEDDING_LENGTH), field(gguf.Keys.Attention.HEAD_COUNT)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=field(gguf.Keys.LLM.FEED_FORWARD_LENGTH),
        num_hidden_layers=field(gguf.Keys.LLM.BLOCK_COUNT),
        num_attention_heads=heads,
        num_key_value_heads=field(gguf.Keys.Attention.HEAD_COUNT_KV, default=heads),
        head_dim=field(gguf.Keys.Attention.KEY_LENGTH, default=max(hidden // heads, 1)),
        rope_theta=_decimal(field(gguf.Keys.Rope.FREQ_BASE, header.number, least=0)),
        rms_norm_eps=_decimal(field(gguf.Keys.Attention.LAYERNORM_RMS_EPS, header.number, least=0)),
        tie_word_embeddings=_OUTPUT not in header.shapes,
    )
    check_layers(config, path)
    return config


def _embedding(header: Header) -> tuple[int, ...]:
    """The shape of the token embedding, which every whole Qwen3 checkpoint has."""
    if _EMBEDDING not in header.shapes:
        raise CheckpointError(f"{header.path}: no tensor {_EMBEDDING!r}: not a whole Qwen3 checkpoint")
    return header.shapes[_EMBEDDING]


def _decimal(value) -> float:
    """The shortest decimal a stored float32 rounds from (1e-06, as config.json says, not 9.99999997e-07):
    the same float32 in every product, and configs that compare equal."""
    return float(str(np.float32(value)))


def gguf_names(config: Qwen3Config) -> dict[str, str]:
    """The GGUF tensor name of every checkpoint key of a Qwen3 model (`model.layers.3.self_attn.q_proj.weight`
    -> `blk.3.attn_q.weight`), from the `gguf` package's table for `MODEL_ARCH.QWEN3`."""
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, config.num_hidden_layers)
    keys = skipped_keys(config, 0) | {_EMBEDDING_KEY}  # every key of the checkpoint
    return {key: table.get_name(key, try_suffixes=(".weight",)) for key in sorted(keys)}
