"""Which published variant a checkpoint holds: from its `model_index.json`, or a single file's name, and
its transformer's shapes (where checkpoints live is `klein.io.sources`)."""

from __future__ import annotations

import re
from pathlib import Path

from klein.errors import CheckpointError
from klein.io.json_file import read_json
from klein.models import variants
from klein.models.transformer_config import TransformerConfig


def detect(folder: Path, transformer: TransformerConfig) -> variants.Variant:
    """The variant of a diffusers-layout checkpoint, from `model_index.json` and the transformer shape.

    Checkpoints whose transformer matches no official size (e.g. the demo or test models) get a
    variant named after the folder with the same pipeline semantics.
    """
    index = _model_index(folder)
    kv = index.get("_class_name") == "Flux2KleinKVPipeline"
    distilled = bool(index.get("is_distilled", True)) or kv
    size = variants.size_of(transformer)
    if size is None:
        return variants.Variant(f"custom ({folder.name})", None, kv=kv, distilled=distilled)
    name = variants.name_of(size, kv, distilled)
    if name not in variants.VARIANTS:
        raise CheckpointError(
            f"{folder}: a {size.name} transformer with KV pipeline is not a published variant"
        )
    return variants.VARIANTS[name]


def variant_of_file(
    path: Path, transformer: TransformerConfig, forced: str | None = None
) -> variants.Variant:
    """The variant of a transformer kept outside a diffusers pipeline folder (a single file or a bare
    transformer folder): the size from its shapes, "base" and "kv" from its name as BFL names its files
    (`flux-2-klein-base-9b.safetensors`, `flux-2-klein-9b-kv-fp8.safetensors`), unless `forced` names the
    variant; a forced variant must match the shapes."""
    if forced is not None:
        return _forced(path, transformer, forced)
    words = set(re.split(r"[^a-z0-9]+", path.stem.lower()))
    kv, distilled = "kv" in words, "base" not in words
    size = variants.size_of(transformer)
    if size is None:
        return variants.Variant(f"custom ({path.name})", None, kv=kv, distilled=distilled)
    name = variants.name_of(size, kv, distilled)
    if name not in variants.VARIANTS:
        raise CheckpointError(
            f"{path}: its name suggests {name}, which is not a published variant; name the variant "
            f"explicitly ({', '.join(variants.VARIANTS)})"
        )
    return variants.VARIANTS[name]


def _forced(path: Path, transformer: TransformerConfig, forced: str) -> variants.Variant:
    if forced not in variants.VARIANTS:
        raise CheckpointError(f"unknown variant {forced!r}; known: {', '.join(variants.VARIANTS)}")
    size = variants.size_of(transformer)
    if size != variants.VARIANTS[forced].size:
        holds = f"a klein-{size.name}" if size else "a non-standard"
        raise CheckpointError(
            f"{path}: holds {holds} transformer ({transformer.num_layers} double + "
            f"{transformer.num_single_layers} single blocks, width {transformer.hidden}), not {forced}"
        )
    return variants.VARIANTS[forced]


def _model_index(folder: Path) -> dict:
    path = folder / "model_index.json"
    if not path.is_file():
        raise CheckpointError(
            f"{folder}: no model_index.json; point --model at a diffusers-layout FLUX.2 [klein] folder"
        )
    index = read_json(path, "the pipeline index")
    if index.get("_class_name") not in ("Flux2KleinPipeline", "Flux2KleinKVPipeline"):
        raise CheckpointError(f"{path}: pipeline class {index.get('_class_name')!r} is not FLUX.2 [klein]")
    return index
