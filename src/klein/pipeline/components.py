"""Where the parts of a pipeline come from: one diffusers-layout checkpoint, or parts named one by one (a
transformer file, the FLUX.2 `ae.safetensors` or FLUX.2-small-decoder's files, a Qwen3 folder or GGUF),
each a local file or folder or a Hugging Face repo id; a folder or repo holding a whole pipeline gives the
part's subfolder.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import numpy as np

from klein import dtypes, sharding
from klein.errors import CheckpointError, InputError
from klein.io import sources, vae_checkpoint
from klein.io.gguf_tokenizer import holds_tokenizer
from klein.io.safetensors import TensorSource
from klein.io.text_encoder_checkpoint import load_text_encoder, read_table
from klein.io.text_encoder_checkpoint import read_config as read_text_encoder_config
from klein.io.text_encoder_gguf import load_text_encoder_gguf, read_gguf_config
from klein.io.transformer_checkpoint import load_transformer
from klein.io.transformer_checkpoint import read_config as read_transformer_config
from klein.io.transformer_file import file_config, load_transformer_file
from klein.models import products, variants
from klein.models.qwen3 import PROMPT_LAYERS, Qwen3TextEncoder
from klein.models.qwen3_config import Qwen3Config
from klein.models.transformer import Flux2Transformer
from klein.models.transformer_config import TransformerConfig
from klein.models.vae import AutoencoderKLFlux2, VAEConfig
from klein.pipeline import checkpoints


@dataclasses.dataclass(frozen=True)
class Parts:
    """Where each part is: a file, a folder or a repo id; None takes it from the checkpoint."""

    transformer: str | Path | None = None
    text_encoder: str | Path | None = None
    vae: str | Path | None = None
    tokenizer: str | Path | None = None


@dataclasses.dataclass(frozen=True)
class Located:
    """Where each part of a pipeline is, and what it holds, read from configs and file headers alone:
    no weight is read until a `load_*` function is called."""

    name: str
    variant: variants.Variant
    transformer: Path
    text_encoder: Path
    vae: Path
    tokenizer: Path
    config: TransformerConfig
    text_config: Qwen3Config
    vae_config: VAEConfig
    own_vae: Path | None
    """Where `vae` is a single file, the model's own VAE, if any: it gives the file's config (widths aside)
    and completes a decoder-only file (`small_decoder.safetensors`) with its encoder and latent statistics."""
    stored_dtype: np.dtype
    """The float dtype the transformer's weights are stored in (FP8 files: bfloat16, their compute dtype)."""
    fp8: bool
    """Whether the transformer file holds FP8 weights (kept FP8 in memory unless dequantised)."""


def locate(source, parts: Parts, variant=None, mesh=None) -> Located:
    """Find every part, read its config, and check (before any weight is read) that the mesh, if any,
    splits the models evenly."""
    for field in dataclasses.fields(parts):  # a part named but missing is named first, before the others
        if getattr(parts, field.name) is not None:
            _local(getattr(parts, field.name), field.name.replace("_", " "))
    root, name = _checkpoint(source, parts)
    named = {field.name: getattr(parts, field.name) or root for field in dataclasses.fields(Parts)}
    transformer = _locate(named["transformer"])
    encoder = _part(named["text_encoder"], "text_encoder")
    if encoder.is_file() and encoder.suffix.lower() != ".gguf":
        raise CheckpointError(
            f"{encoder}: the text encoder must be a folder (config.json and model*.safetensors, e.g. a Qwen3 "
            f"repo) or a Qwen3 GGUF file, not another single file"
        )
    if transformer.is_file():
        config = file_config(transformer)
    else:
        config = read_transformer_config(_transformer_folder(transformer))
    text_config = read_gguf_config(encoder) if encoder.is_file() else read_text_encoder_config(encoder)
    if named["tokenizer"] is None:
        named["tokenizer"] = _tokenizer_beside(_locate(named["text_encoder"]))
    found = _variant(transformer, config, variant)
    _check_text_encoder(encoder, text_config, config, found)
    if mesh is not None:  # fail before any weight is read when the mesh cannot split the models evenly
        sharding.check_divisible(mesh, "the transformer", sharding.transformer_dims(config))
        sharding.check_divisible(mesh, "the text encoder", sharding.text_encoder_dims(text_config))
    vae = _part(named["vae"], "vae")
    own_vae = _own_vae(root) if vae.is_file() else None
    return Located(
        name=str(parts.transformer) if parts.transformer else name,
        variant=found,
        transformer=transformer,
        text_encoder=encoder,
        vae=vae,
        tokenizer=_part(named["tokenizer"], "tokenizer"),
        config=config,
        text_config=text_config,
        vae_config=vae_checkpoint.vae_config(vae, own_vae),
        own_vae=own_vae,
        **_stored(transformer),
    )


def locate_transformer_file(path: Path, variant: str | None = None) -> tuple:
    """(config, variant, stored dtype, fp8) of a single transformer file, read from its header alone."""
    config = file_config(path)
    stored = _stored(path)
    return config, _variant(path, config, variant), stored["stored_dtype"], stored["fp8"]


def load_transformer_part(
    located: Located, dtype, dequantize=False, mesh=None, host: tuple[str, ...] = (), compute=products.BF16
) -> Flux2Transformer:
    """`host`: dotted prefixes of the weights that go to host memory (`klein.sharding.placer`); `compute`:
    how the blocks' products are made (their weights quantised at load for an 8-bit one)."""
    place = sharding.placer(mesh, sharding.TRANSFORMER_PARAMS, host)
    path = located.transformer
    if path.is_file():
        return load_transformer_file(path, dtype, place=place, dequantize=dequantize, compute=compute)
    return load_transformer(_transformer_folder(path), dtype, place=place, compute=compute)


def load_text_encoder_part(
    located: Located, dtype, dequantize=False, mesh=None, host: tuple[str, ...] = (), blocks=None
) -> Qwen3TextEncoder:
    """`dequantize`: a GGUF file's quantised Linears widened to `dtype` at load, not kept as blocks;
    `blocks`: a folder's Linears quantised at load into those ggml blocks, its token table left out
    (`read_text_table`)."""
    path = located.text_encoder
    place = sharding.placer(mesh, sharding.TEXT_ENCODER_PARAMS, host)
    if path.is_file():
        return load_text_encoder_gguf(path, dtype, place=place, dequantize=dequantize)
    return load_text_encoder(path, dtype, place=place, blocks=blocks)


def read_text_table(located: Located, dtype) -> np.ndarray:
    """The token table of the text encoder folder `located` names, in host memory."""
    return read_table(located.text_encoder, dtype)


def load_vae_part(located: Located, dtype, mesh=None) -> AutoencoderKLFlux2:
    path, place = located.vae, sharding.placer(mesh)
    if not path.is_file():
        return vae_checkpoint.load_vae(path, dtype, place=place)
    try:
        return vae_checkpoint.load_vae_file(path, dtype, place=place, own=located.own_vae)
    except CheckpointError as error:
        if "does not match the model" not in str(error):
            raise
        raise CheckpointError(_unfitting_vae(located, error)) from None


def _unfitting_vae(located: Located, error: CheckpointError) -> str:
    """What to do when a single-file VAE's tensors do not fit the config it takes from the model's own VAE
    (all but its widths: layers per level, groups of its norms), as FLUX.2's files do not fit the demo's."""
    own = "the FLUX.2 VAE" if located.own_vae is None else f"the model's own VAE ({located.own_vae})"
    return (
        f"{located.vae}: a single-file VAE takes its config, all but its widths, from {own}, and its tensors "
        f"do not fit it ({str(error).splitlines()[1].split(':')[0].strip()}): give the model it belongs with (for FLUX.2's "
        f"ae.safetensors and FLUX.2-small-decoder's files, from {vae_checkpoint.SMALL_DECODER}, a FLUX.2 "
        f"[klein] model such as {variants.VARIANTS['klein-4b'].repo_id}), or a VAE folder (config.json and "
        "weights)"
    )


def _check_text_encoder(path: Path, text: Qwen3Config, config: TransformerConfig, variant) -> None:
    """Refuse, before any weight is read, a text encoder of another Qwen3 size than a published variant's,
    or one whose prompt embedding the transformer cannot take."""
    size = variant.size.text_encoder if variant.size else None
    if size is not None and _shape(text) != _shape(size):
        raise CheckpointError(
            f"{path}: a Qwen3 text encoder of {_described(text)}; {variant.name} takes one of "
            f"{_described(size)} (Qwen3-4B for the 4b variants, Qwen3-8B for the 9b ones)"
        )
    layers = len(PROMPT_LAYERS)
    if layers * text.hidden_size != config.joint_attention_dim:
        raise CheckpointError(
            f"{path}: a Qwen3 text encoder of hidden size {text.hidden_size}; this transformer takes prompt "
            f"embeddings of {layers} hidden states {config.joint_attention_dim // layers} wide"
        )


def _shape(config: Qwen3Config) -> tuple:
    return (config.hidden_size, config.intermediate_size, config.num_hidden_layers,
            config.num_attention_heads, config.num_key_value_heads, config.head_dim)  # fmt: skip


def _described(config: Qwen3Config) -> str:
    return (
        f"hidden size {config.hidden_size}, {config.num_hidden_layers} layers, {config.num_attention_heads} "
        f"heads ({config.num_key_value_heads} key/value)"
    )


def _stored(path: Path) -> dict:
    """`stored_dtype`: the float dtype most of the transformer's weights are stored in, FP8 and GGUF files
    computing in bf16, the precision their weights were quantised from; `fp8`: whether it holds FP8."""
    if path.suffix.lower() == ".gguf":
        return dict(stored_dtype=dtypes.dtype("bfloat16"), fp8=False)
    if path.is_file():
        source = TensorSource.from_file(path)
    else:
        source = TensorSource.from_folder(_transformer_folder(path), "diffusion_pytorch_model")
    stored = Counter(source.dtype(key) for key in source.keys())
    name = max(_STORED, key=lambda kind: sum(stored[code] for code in _STORED[kind]))
    return dict(stored_dtype=dtypes.dtype(name), fp8=stored["F8_E4M3"] > 0)


# The safetensors dtype codes stored for each compute dtype.
_STORED = {"bfloat16": ("BF16", "F16", "F8_E4M3", "F8_E5M2"), "float32": ("F32", "F64")}


def _checkpoint(source, parts: Parts) -> tuple[Path | None, str | None]:
    """The checkpoint the unnamed parts come from: `source`, or the demo when nothing at all is named."""
    if source is None and parts == Parts():
        source = sources.DEMO
    if source is not None:
        return sources.resolve(source)
    missing = [part for part in ("transformer", "text_encoder", "vae") if getattr(parts, part) is None]
    if missing:
        demo = "; the demo's parts fit only the demo's transformer" if parts.transformer is not None else ""
        raise InputError(
            f"no model to take the {', '.join(missing)} from: name every part, or a diffusers-layout model "
            f"(folder or repo id) that holds the others{demo}"
        )
    return None, None


def _local(spec, part: str = "checkpoint") -> Path | None:
    """The file or folder `spec` names, None for a repo id; a `CheckpointError` naming it, and the `part`
    it was to be, where it is neither a repo id nor there."""
    path = Path(spec).expanduser()
    if path.exists():
        return path
    if path.suffix.lower() in (".safetensors", ".sft", ".gguf"):
        raise CheckpointError(f"{path}: no such file (the {part})")
    if not sources.remote(str(spec)):
        raise CheckpointError(f"{path}: no such file or folder (the {part}), nor a Hugging Face repo id")
    return None


def _locate(spec) -> Path:
    local = _local(spec)
    return local if local is not None else sources.resolve(str(spec))[0]  # a repo id


def _part(spec, subfolder: str) -> Path:
    """A part's own file or folder: `<folder>/<subfolder>` when the folder holds a whole pipeline."""
    path = _locate(spec)
    return path / subfolder if (path / subfolder).is_dir() else path


def _own_vae(root: Path | None) -> Path | None:
    """The VAE folder of the model at `root`, if it has one."""
    folder = None if root is None else _part(root, "vae")
    return folder if folder is not None and (folder / "config.json").is_file() else None


def _tokenizer_beside(text_encoder: Path) -> Path:
    if text_encoder.is_file():  # a GGUF: the tokenizer in its metadata
        if holds_tokenizer(text_encoder):
            return text_encoder
        raise InputError(
            f"{text_encoder} holds no tokenizer in its metadata: name the tokenizer's folder too"
        )
    for folder in (text_encoder / "tokenizer", text_encoder):
        if (folder / "tokenizer.json").is_file():
            return folder
    raise InputError(f"{text_encoder} holds no tokenizer.json: name the tokenizer's folder or repo too")


def _transformer_folder(path: Path) -> Path:
    return path / "transformer" if (path / "model_index.json").is_file() else path


def _variant(path: Path, config: TransformerConfig, variant: str | None) -> variants.Variant:
    if variant is None and (path / "model_index.json").is_file():  # a pipeline's index says which
        return checkpoints.detect(path, config)
    return checkpoints.variant_of_file(path, config, variant)
