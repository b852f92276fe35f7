"""Generation modes, chosen once per request: how references enter the transformer, and whether CFG runs.

Two independent axes (docs/design.md, "Modes"):
- conditioning: text only; references appended to the image tokens and attended with full attention at
  every step (klein-4b / 9b / base, or a KV checkpoint with use_kv=False); or cached references, whose
  per-layer keys and values come from one prefill (klein-9b-kv);
- guidance: the base variants run classifier-free guidance (prompt and negative in one doubled batch);
  the step-distilled ones ignore any guidance scale, as diffusers does.

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

    def __str__(self) -> str:
        return self.conditioning.value + (" + CFG" if self.guided else "")
