"""Generation modes, chosen once per request: how references enter the transformer, and whether CFG runs.

Two independent axes (docs/design.md, "Modes"):
- conditioning: text only; references appended to the image tokens and attended with full attention at
  every step (klein-4b / 9b / base, or a KV checkpoint with use_kv=False); or cached references, whose
  per-layer keys and values come from one prefill (klein-9b-kv);
- guidance: the base variants run classifier-free guidance (prompt and negative in one doubled batch);
  the step-distilled ones ignore any guidance scale, as diffusers does.

A repaint (inpainting, image-to-image) is named beside them, for the summaries that say what ran; it
runs the same step function as its conditioning.

`klein.request.resolve` is the only place these are decided; the pipeline then runs the step function of
that mode.
"""

from __future__ import annotations

import dataclasses
import enum


class Conditioning(enum.Enum):
    TEXT = "text-to-image"
    REFERENCES = "references"
    CACHED = "cached references"


@dataclasses.dataclass(frozen=True)
class Mode:
    conditioning: Conditioning
    guided: bool
    """Classifier-free guidance: each step runs the prompt and the negative prompt as one batch."""
    repaint: str | None = dataclasses.field(default=None, compare=False)
    """How the first image is repainted ("inpainting with a mask at strength 0.8"), None when it is not:
    a description only, so modes that differ in it share a step function."""

    def __str__(self) -> str:
        repaint = f"{self.repaint}, " if self.repaint else ""
        return repaint + self.conditioning.value + (" + CFG" if self.guided else "")


def repaint_words(masked: bool, strength: float) -> str:
    """How a repaint is named in summaries, the CLI's, `describe()`'s and the PNG's `mode`."""
    if masked:
        return f"inpainting with a mask at strength {strength:g}"
    return f"image-to-image at strength {strength:g}"
