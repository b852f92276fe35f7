"""Generation modes, chosen once per request: how references enter the transformer, and whether CFG runs.

Two independent axes (docs/design.md, "Modes"):
- conditioning: text only; references appended to the image tokens and attended with full attention at
  every step (klein-4b / 9b / base, or a KV checkpoint with use_kv=False); or cached references, whose
  per-layer keys and values come from one prefill (klein-9b-kv);
- guidance: the base variants run classifier-free guidance (prompt and negative in one doubled batch);
  the step-distilled ones ignore any guidance scale, as diffusers does.

`resolve` is the only place these are decided; the pipeline then runs the step function of that mode.
"""

from __future__ import annotations

import dataclasses
import enum

from klein.errors import InputError
from klein.variants import KV_CHECKPOINT, Variant


class Conditioning(enum.Enum):
    TEXT = "text-to-image"
    REFERENCES = "references"
    CACHED = "cached references"


@dataclasses.dataclass(frozen=True)
class Mode:
    conditioning: Conditioning
    guided: bool
    """Classifier-free guidance: each step runs the prompt and the negative prompt as one batch."""

    def __str__(self) -> str:
        return self.conditioning.value + (" + CFG" if self.guided else "")

    @classmethod
    def parse(cls, text: str) -> Mode:
        """The mode `str(mode)` wrote (PNG metadata)."""
        name, _, guided = text.partition(" + ")
        try:
            return cls(Conditioning(name), guided == "CFG")
        except ValueError:
            raise InputError(f"unknown mode {text!r}") from None


def conditioning(
    variant: Variant, model_name: str, use_kv: bool | None, has_references: bool
) -> Conditioning:
    """How references (if any) enter: cached on KV checkpoints unless `use_kv` says otherwise."""
    if use_kv and not variant.kv:
        raise InputError(
            f"use_kv=True needs a KV checkpoint such as {KV_CHECKPOINT.name} ({KV_CHECKPOINT.repo_id}); "
            f"{model_name} is {variant.name}. Drop use_kv or load the KV checkpoint."
        )
    if not has_references:
        return Conditioning.TEXT
    cached = variant.kv if use_kv is None else use_kv
    return Conditioning.CACHED if cached else Conditioning.REFERENCES


def guidance(variant: Variant, scale: float | None) -> float | None:
    """The guidance scale that runs, or None when none does (distilled variants; a scale of 1 or less)."""
    if variant.distilled:
        return None
    scale = variant.guidance if scale is None else float(scale)
    return scale if scale > 1.0 else None
