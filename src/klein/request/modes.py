"""Generation modes: how references enter the transformer (text only, appended, cached keys and values) and
whether CFG runs, decided once per request by `klein.request.resolve` (docs/design/requests.md, "Modes")."""

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
