"""Where the parts of a pipeline come from: one diffusers-layout checkpoint, or parts named one by one.

Single-file users keep the parts apart: a BFL, FP8 or GGUF transformer file, the FLUX.2 `ae.safetensors`, a
Qwen3 folder. Each part is a local file or folder, or a Hugging Face repo id; a folder or repo that holds a
whole pipeline gives the part's subfolder. Parts not named come from the checkpoint (`source`); with no
checkpoint every part must be named, except the tokenizer, which the text encoder's folder usually holds.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from klein import checkpoints, sharding, text, variants
from klein.errors import CheckpointError, InputError
from klein.io.text_encoder_checkpoint import load_text_encoder
from klein.io.text_encoder_checkpoint import read_config as read_text_encoder_config
from klein.io.transformer_checkpoint import load_transformer
from klein.io.transformer_file import file_config, load_transformer_file
from klein.io.vae_checkpoint import load_vae, load_vae_file
from klein.models.qwen3 import Qwen3TextEncoder
from klein.models.transformer import Flux2Transformer
from klein.models.transformer_config import TransformerConfig
from klein.models.vae import AutoencoderKLFlux2


@dataclasses.dataclass(frozen=True)
class Parts:
    """Where each part is: a file, a folder or a repo id; None takes it from the checkpoint."""

    transformer: str | Path | None = None
    text_encoder: str | Path | None = None
    vae: str | Path | None = None
    tokenizer: str | Path | None = None


@dataclasses.dataclass(frozen=True)
class Components:
    name: str
    variant: variants.Variant
    transformer: Flux2Transformer
    vae: AutoencoderKLFlux2
    text_encoder: Qwen3TextEncoder
    tokenizer: text.PromptTokenizer


def load_components(source, parts: Parts, dtype, variant=None, dequantize=False, mesh=None) -> Components:
    """Load every part; `variant` names the transformer's variant explicitly, `dequantize` widens FP8
    weights, `mesh` (a jax Mesh or None) places every weight straight onto its shards."""
    root, name = _checkpoint(source, parts)
    named = {field.name: getattr(parts, field.name) or root for field in dataclasses.fields(Parts)}
    if named["tokenizer"] is None:
        named["tokenizer"] = _tokenizer_beside(_locate(named["text_encoder"]))
    transformer_path = _locate(named["transformer"])
    encoder_folder = _text_encoder_folder(_part(named["text_encoder"], "text_encoder"))
    _check_fits(mesh, transformer_path, encoder_folder)
    place = sharding.placer(mesh, sharding.TRANSFORMER_PARAMS)
    chosen, transformer = _transformer(transformer_path, dtype, variant, dequantize, place)
    place_encoder = sharding.placer(mesh, sharding.TEXT_ENCODER_PARAMS)
    return Components(
        name=str(parts.transformer) if parts.transformer else name,
        variant=chosen,
        transformer=transformer,
        vae=_vae(_part(named["vae"], "vae"), dtype, sharding.placer(mesh)),
        text_encoder=load_text_encoder(encoder_folder, dtype, place=place_encoder),
        tokenizer=text.load_tokenizer(_part(named["tokenizer"], "tokenizer")),
    )


def _check_fits(mesh, transformer: Path, text_encoder: Path) -> None:
    """Fail before reading any weight when the mesh cannot split the models evenly."""
    if mesh is None:
        return
    if transformer.is_file():
        config = file_config(transformer)
    else:
        config = TransformerConfig.from_file(_transformer_folder(transformer) / "config.json")
    sharding.check_divisible(mesh, "the transformer", sharding.transformer_dims(config))
    encoder = read_text_encoder_config(text_encoder)
    sharding.check_divisible(mesh, "the text encoder", sharding.text_encoder_dims(encoder))


def _checkpoint(source, parts: Parts) -> tuple[Path | None, str | None]:
    """The checkpoint the unnamed parts come from: `source`, or the demo when nothing at all is named."""
    if source is None and parts == Parts():
        source = checkpoints.DEMO
    if source is not None:
        return checkpoints.resolve(source)
    missing = [part for part in ("transformer", "text_encoder", "vae") if getattr(parts, part) is None]
    if missing:
        raise InputError(
            f"no model to take the {', '.join(missing)} from: name every part, or a diffusers-layout model "
            f"(folder or repo id) that holds the others"
        )
    return None, None


def _locate(spec) -> Path:
    path = Path(spec).expanduser()
    if path.exists():
        return path
    if path.suffix.lower() in (".safetensors", ".sft", ".gguf"):
        raise CheckpointError(f"{path}: no such file")
    return checkpoints.resolve(str(spec))[0]  # a repo id (or the error naming what is accepted)


def _part(spec, subfolder: str) -> Path:
    """A part's own file or folder: `<folder>/<subfolder>` when the folder holds a whole pipeline."""
    path = _locate(spec)
    return path / subfolder if (path / subfolder).is_dir() else path


def _tokenizer_beside(text_encoder: Path) -> Path:
    for folder in (text_encoder / "tokenizer", text_encoder):
        if (folder / "tokenizer.json").is_file():
            return folder
    raise InputError(f"{text_encoder} holds no tokenizer.json: name the tokenizer's folder or repo too")


def _transformer_folder(path: Path) -> Path:
    return path / "transformer" if (path / "model_index.json").is_file() else path


def _transformer(path: Path, dtype, variant, dequantize, place):
    if path.is_file():
        chosen = variants.from_file(path, file_config(path), variant)  # before reading any weight
        return chosen, load_transformer_file(path, dtype, place=place, dequantize=dequantize)
    pipeline = (path / "model_index.json").is_file()
    model = load_transformer(_transformer_folder(path), dtype, place=place)
    if pipeline and variant is None:  # a whole pipeline's index says which variant it is
        return variants.detect(path, model.cfg), model
    return variants.from_file(path, model.cfg, variant), model


def _vae(path: Path, dtype, place):
    return (load_vae_file if path.is_file() else load_vae)(path, dtype, place=place)


def _text_encoder_folder(path: Path) -> Path:
    if path.is_file():
        raise CheckpointError(
            f"{path}: the text encoder must be a folder (config.json and model*.safetensors, e.g. a Qwen3 "
            f"repo), not a single file"
        )
    return path
