"""The FLUX.2 [klein] variants: the published sizes, names and defaults (`klein.pipeline.checkpoints`
tells which one a checkpoint holds)."""

from __future__ import annotations

import dataclasses

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
DEMO_LABEL = "demo checkpoint: tiny random weights, the image is noise-like"
"""The name the built-in demo checkpoint is shown under (`klein.io.sources`): its weights are random."""


def size_of(transformer: TransformerConfig) -> Size | None:
    """The published size whose transformer has exactly this configuration, if any."""
    return next((s for s in SIZES.values() if s.transformer == transformer), None)


def kv_checkpoint_for(repo_id: str) -> str:
    """The seed's usage asks for klein-9B with use_kv=True and means the klein-9b-kv checkpoint."""
    if repo_id.lower() == VARIANTS["klein-9b"].repo_id.lower():
        return KV_CHECKPOINT.repo_id
    return repo_id


def name_of(size: Size, kv: bool, distilled: bool) -> str:
    return f"klein-{'' if distilled else 'base-'}{size.name}{'-kv' if kv else ''}"
