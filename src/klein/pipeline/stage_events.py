"""What a generation is doing, as events: the one source of progress for every front end. The pipeline's
`Stages` helper (`klein.pipeline.timing`) announces each stage as it starts, starts compiling and ends;
the denoising loop reports each step. The CLI draws them on stderr, the Python API as a tqdm bar
(`klein.pipeline.progress_bar`), `klein serve` as a job's events.
"""

from __future__ import annotations

import dataclasses

LABELS = {
    "text": "encoding prompt",
    "references": "encoding references",
    "prefill": "caching references",
    "denoise": "denoising",
    "decode": "decoding",
    "decode_tiled": "decoding (tiled)",
    "latents": "denormalising latents",
}
"""Each stage as front ends name it."""


@dataclasses.dataclass(frozen=True)
class StageEvent:
    """A stage started (`done` 0), started compiling (`compiling`), made a step (denoising: `done` of
    `total` steps) or finished (`seconds` set)."""

    stage: str
    done: int = 0
    total: int = 1
    seconds: float | None = None
    """The stage's own time once it has finished, its compilation apart; None before."""
    compile_seconds: float = 0.0
    """Of a finished stage: the time XLA spent compiling inside it."""
    compiling: bool = False
    """XLA has started compiling the stage's programs (a first run of these shapes)."""

    @property
    def label(self) -> str:
        return LABELS.get(self.stage, self.stage)

    @property
    def finished(self) -> bool:
        return self.seconds is not None

    @property
    def is_step(self) -> bool:
        """A denoising step finished (the stage's start and end are not steps)."""
        return self.stage == "denoise" and self.done > 0 and not self.finished
