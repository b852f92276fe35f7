"""The FLUX.2 [klein] variants: defaults, and detection from a checkpoint's own files."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from klein.errors import CheckpointError
from klein.models.transformer_config import KLEIN_4B, KLEIN_9B, TransformerConfig


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

    @property
    def steps(self) -> int:
        return 4 if self.distilled else 50

    @property
    def guidance(self) -> float | None:
        return None if self.distilled else 4.0


VARIANTS = {
    v.name: v
    for v in (
        Variant("klein-4b", "black-forest-labs/FLUX.2-klein-4B", kv=False, distilled=True),
        Variant("klein-9b", "black-forest-labs/FLUX.2-klein-9B", kv=False, distilled=True),
        Variant("klein-9b-kv", "black-forest-labs/FLUX.2-klein-9b-kv", kv=True, distilled=True),
        Variant("klein-base-4b", "black-forest-labs/FLUX.2-klein-base-4B", kv=False, distilled=False),
        Variant("klein-base-9b", "black-forest-labs/FLUX.2-klein-base-9B", kv=False, distilled=False),
    )
}
KV_CHECKPOINT = VARIANTS["klein-9b-kv"]
_SIZES = {KLEIN_4B: "4b", KLEIN_9B: "9b"}


def detect(folder: Path, transformer: TransformerConfig) -> Variant:
    """The variant of a diffusers-layout checkpoint, from `model_index.json` and the transformer shape.

    Checkpoints whose transformer matches no official size (e.g. the demo or test models) get a
    variant named after the folder with the same pipeline semantics.
    """
    index = _model_index(folder)
    kv = index.get("_class_name") == "Flux2KleinKVPipeline"
    distilled = bool(index.get("is_distilled", True)) or kv
    size = _SIZES.get(transformer)
    if size is None:
        return Variant(f"custom ({folder.name})", None, kv=kv, distilled=distilled)
    name = f"klein-{size}-kv" if kv else f"klein-{'' if distilled else 'base-'}{size}"
    if name not in VARIANTS:
        raise CheckpointError(f"{folder}: a {size} transformer with KV pipeline is not a published variant")
    return VARIANTS[name]


def from_file(path: Path, transformer: TransformerConfig, forced: str | None = None) -> Variant:
    """The variant of a transformer kept outside a diffusers pipeline folder (a single file or a bare
    transformer folder): the size from its shapes, "base" and "kv" from its name as BFL names its files
    (`flux-2-klein-base-9b.safetensors`, `flux-2-klein-9b-kv-fp8.safetensors`), unless `forced` names the
    variant; a forced variant must match the shapes."""
    size = _SIZES.get(transformer)
    if forced is not None:
        return _forced(path, transformer, size, forced)
    words = set(re.split(r"[^a-z0-9]+", path.stem.lower()))
    kv, distilled = "kv" in words, "base" not in words
    if size is None:
        return Variant(f"custom ({path.name})", None, kv=kv, distilled=distilled)
    name = f"klein-{'' if distilled else 'base-'}{size}{'-kv' if kv else ''}"
    if name not in VARIANTS:
        raise CheckpointError(
            f"{path}: its name suggests {name}, which is not a published variant; name the variant "
            f"explicitly ({', '.join(VARIANTS)})"
        )
    return VARIANTS[name]


def _forced(path: Path, transformer: TransformerConfig, size: str | None, forced: str) -> Variant:
    if forced not in VARIANTS:
        raise CheckpointError(f"unknown variant {forced!r}; known: {', '.join(VARIANTS)}")
    want = "9b" if "9b" in forced else "4b"
    if size != want:
        holds = f"a klein-{size}" if size else "a non-standard"
        raise CheckpointError(
            f"{path}: holds {holds} transformer ({transformer.num_layers} double + "
            f"{transformer.num_single_layers} single blocks, width {transformer.hidden}), not {forced}"
        )
    return VARIANTS[forced]


def _model_index(folder: Path) -> dict:
    path = folder / "model_index.json"
    try:
        index = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"{folder}: no model_index.json; point --model at a diffusers-layout FLUX.2 [klein] folder"
        ) from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable ({exc})") from None
    if index.get("_class_name") not in ("Flux2KleinPipeline", "Flux2KleinKVPipeline"):
        raise CheckpointError(f"{path}: pipeline class {index.get('_class_name')!r} is not FLUX.2 [klein]")
    return index
