"""The FLUX.2 [klein] variants: defaults, and detection from a checkpoint's own files."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from klein.errors import CheckpointError
from klein.io.json_file import read_json
from klein.models.qwen3_config import Qwen3Config
from klein.models.transformer_config import KLEIN_4B, KLEIN_9B, TransformerConfig


@dataclasses.dataclass(frozen=True)
class Size:
    """One model size: the transformer and the text encoder every variant of that size has."""

    name: str
    """"4b" or "9b"."""
    transformer: TransformerConfig
    text_encoder: Qwen3Config


SIZES = {
    s.name: s
    for s in (Size("4b", KLEIN_4B, Qwen3Config.qwen3_4b()), Size("9b", KLEIN_9B, Qwen3Config.qwen3_8b()))
}


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    """Short name, e.g. "klein-9b-kv"."""
    repo_id: str | None
    """Hugging Face repository of the official checkpoint (None for the demo)."""
    kv: bool
    """Trained for cached reference keys/values (klein-9b-kv)."""
    distilled: bool
    """Step-distilled (4 steps, no guidance) rather than base (50 steps, CFG)."""
    size: Size | None = None
    """The published size's configurations; None for a checkpoint of no published size (the demo)."""

    @property
    def steps(self) -> int:
        return 4 if self.distilled else 50

    @property
    def guidance(self) -> float | None:
        return None if self.distilled else 4.0


_4B, _9B = SIZES["4b"], SIZES["9b"]
VARIANTS = {
    v.name: v
    for v in (
        Variant("klein-4b", "black-forest-labs/FLUX.2-klein-4B", kv=False, distilled=True, size=_4B),
        Variant("klein-9b", "black-forest-labs/FLUX.2-klein-9B", kv=False, distilled=True, size=_9B),
        Variant("klein-9b-kv", "black-forest-labs/FLUX.2-klein-9b-kv", kv=True, distilled=True, size=_9B),
        Variant(
            "klein-base-4b", "black-forest-labs/FLUX.2-klein-base-4B", kv=False, distilled=False, size=_4B
        ),
        Variant(
            "klein-base-9b", "black-forest-labs/FLUX.2-klein-base-9B", kv=False, distilled=False, size=_9B
        ),
    )
}
KV_CHECKPOINT = VARIANTS["klein-9b-kv"]


def size_of(transformer: TransformerConfig) -> Size | None:
    """The published size whose transformer has exactly this configuration, if any."""
    return next((s for s in SIZES.values() if s.transformer == transformer), None)


def kv_checkpoint_for(repo_id: str) -> str:
    """The seed's usage asks for klein-9B with use_kv=True and means the klein-9b-kv checkpoint."""
    if repo_id.lower() == VARIANTS["klein-9b"].repo_id.lower():
        return KV_CHECKPOINT.repo_id
    return repo_id


def detect(folder: Path, transformer: TransformerConfig) -> Variant:
    """The variant of a diffusers-layout checkpoint, from `model_index.json` and the transformer shape.

    Checkpoints whose transformer matches no official size (e.g. the demo or test models) get a
    variant named after the folder with the same pipeline semantics.
    """
    index = _model_index(folder)
    kv = index.get("_class_name") == "Flux2KleinKVPipeline"
    distilled = bool(index.get("is_distilled", True)) or kv
    size = size_of(transformer)
    if size is None:
        return Variant(f"custom ({folder.name})", None, kv=kv, distilled=distilled)
    name = _name(size, kv, distilled)
    if name not in VARIANTS:
        raise CheckpointError(
            f"{folder}: a {size.name} transformer with KV pipeline is not a published variant"
        )
    return VARIANTS[name]


def from_file(path: Path, transformer: TransformerConfig, forced: str | None = None) -> Variant:
    """The variant of a transformer kept outside a diffusers pipeline folder (a single file or a bare
    transformer folder): the size from its shapes, "base" and "kv" from its name as BFL names its files
    (`flux-2-klein-base-9b.safetensors`, `flux-2-klein-9b-kv-fp8.safetensors`), unless `forced` names the
    variant; a forced variant must match the shapes."""
    if forced is not None:
        return _forced(path, transformer, forced)
    words = set(re.split(r"[^a-z0-9]+", path.stem.lower()))
    kv, distilled = "kv" in words, "base" not in words
    size = size_of(transformer)
    if size is None:
        return Variant(f"custom ({path.name})", None, kv=kv, distilled=distilled)
    name = _name(size, kv, distilled)
    if name not in VARIANTS:
        raise CheckpointError(
            f"{path}: its name suggests {name}, which is not a published variant; name the variant "
            f"explicitly ({', '.join(VARIANTS)})"
        )
    return VARIANTS[name]


def _name(size: Size, kv: bool, distilled: bool) -> str:
    return f"klein-{'' if distilled else 'base-'}{size.name}{'-kv' if kv else ''}"


def _forced(path: Path, transformer: TransformerConfig, forced: str) -> Variant:
    if forced not in VARIANTS:
        raise CheckpointError(f"unknown variant {forced!r}; known: {', '.join(VARIANTS)}")
    size = size_of(transformer)
    if size != VARIANTS[forced].size:
        holds = f"a klein-{size.name}" if size else "a non-standard"
        raise CheckpointError(
            f"{path}: holds {holds} transformer ({transformer.num_layers} double + "
            f"{transformer.num_single_layers} single blocks, width {transformer.hidden}), not {forced}"
        )
    return VARIANTS[forced]


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
