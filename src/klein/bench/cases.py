"""What one benchmark run covers: the cases (one image per call, one square output size each), their token
counts, and their inputs, fixed per case so that both engines see the same latents and reference pictures.
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np
import PIL.Image

from klein.bench.configs import TEXT_TOKENS, BenchConfig

PROMPT = "a photo of a cat wearing a small red hat, sitting on a blue sofa"


class CaseKind(enum.Enum):
    """What a benchmark case measures. It is not a request's mode: the engines pass `image`, `use_kv` or
    encoded `references`, and the pipeline's `resolve` decides the mode from them."""

    TEXT_TO_IMAGE = "text-to-image"
    STANDARD = "standard editing"
    KV = "KV editing"
    KV_WARM = "KV editing, warm references"


@dataclasses.dataclass(frozen=True)
class Case:
    mode: CaseKind
    references: int
    size: int
    """Square output side in px."""

    @property
    def name(self) -> str:
        refs = "" if self.mode is CaseKind.TEXT_TO_IMAGE else f", {self.references} ref"
        return f"{self.mode.value}{refs}, {self.size}px"


@dataclasses.dataclass(frozen=True)
class Tokens:
    text: int
    image: int
    reference: int
    """All references together."""


def cases(config: BenchConfig) -> list[Case]:
    """Per output size: text-to-image, then per reference count standard, KV and warm KV editing."""
    modes = (CaseKind.STANDARD, CaseKind.KV, CaseKind.KV_WARM) if config.kv else (CaseKind.STANDARD,)
    out = []
    for size in config.output_sizes:
        out.append(Case(CaseKind.TEXT_TO_IMAGE, 0, size))
        out += [Case(mode, n, size) for n in config.reference_counts for mode in modes]
    return out


def tokens(config: BenchConfig, case: Case) -> Tokens:
    token = config.pixels_per_token
    per_reference = (config.reference_size // token) ** 2
    return Tokens(TEXT_TOKENS, (case.size // token) ** 2, case.references * per_reference)


def latents(config: BenchConfig, case: Case) -> np.ndarray:
    """The initial noise float[1, 128, H/16, W/16] (diffusers' `latents` layout), fixed per size."""
    grid = case.size // config.pixels_per_token
    return np.random.default_rng(case.size).standard_normal((1, 128, grid, grid)).astype(np.float32)


def reference_images(config: BenchConfig, count: int) -> list[PIL.Image.Image]:
    """Smooth random pictures (a photo-like input, not noise), the same for every case."""
    side = config.reference_size
    grid = max(2, side // 32)
    coarse = [np.random.default_rng(100 + index).uniform(0, 255, (grid, grid, 3)) for index in range(count)]
    return [PIL.Image.fromarray(c.astype(np.uint8)).resize((side, side), PIL.Image.BILINEAR) for c in coarse]
