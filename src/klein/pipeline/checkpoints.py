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
    """The variant of a diffusers-layout checkpoint, from `model_index.json` and the transformer shape."""
    index = _model_index(folder)
    kv = index.get("_class_name") == "Flux2KleinKVPipeline"
    distilled = bool(index.get("is_distilled", True)) or kv
    refusal = "a {size} transformer with KV pipeline is not a published variant"
    return _published(folder, transformer, kv, distilled, refusal)


def variant_of_file(
    path: Path, transformer: TransformerConfig, forced: str | None = None
) -> variants.Variant:
    """The variant of a transformer kept outside a diffusers pipeline folder (a single file or a bare
    transformer folder): the size from its shapes, "base" and "kv" from its name as BFL names its files
    (`flux-2-klein-base-9b.safetensors`, `flux-2-klein-9b-kv-fp8.safetensors`), unless `forced` names the
    variant; a forced variant must match the shapes."""
    if forced is not None:
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
    words = set(re.split(r"[^a-z0-9]+", path.stem.lower()))
    kv, distilled = "kv" in words, "base" not in words
    known = ", ".join(variants.VARIANTS)
    refusal = (
        f"its name suggests {{name}}, which is not a published variant; name the variant explicitly ({known})"
    )
    return _published(path, transformer, kv, distilled, refusal)


def _published(path: Path, transformer: TransformerConfig, kv: bool, distilled: bool, refusal: str):
    """The published variant of `transformer`'s size, `kv` and `distilled`, refused in the words of
    `refusal` (with `{size}` and `{name}`) where there is none; a variant named after `path` with the
    same pipeline semantics where the shapes match no published size (the demo, test models)."""
    size = variants.size_of(transformer)
    if size is None:
        return variants.Variant(f"custom ({path.name})", None, kv=kv, distilled=distilled)
    name = variants.name_of(size, kv, distilled)
    if name not in variants.VARIANTS:
        raise CheckpointError(f"{path}: " + refusal.format(size=size.name, name=name))
    return variants.VARIANTS[name]


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
