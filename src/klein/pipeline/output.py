"""What a generation returns: the images (or latents), the seed, the stage timings and the settings that
ran, which a saved PNG carries as its metadata."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import PIL.Image

from klein import images
from klein.errors import InputError
from klein.io import png
from klein.pipeline.cache_report import CacheReport
from klein.request.request import Settings
from klein.version import version


@dataclasses.dataclass
class GenerationOutput:
    images: list[PIL.Image.Image] | np.ndarray
    seed: int
    timings: dict[str, float]
    settings: Settings
    """What ran (`klein.request.request.Settings`): the PNG metadata is written from it."""
    step_cache: CacheReport | None = None
    """What the request's step cache decided at each step (None without one)."""
    buckets: dict | None = None
    """The token buckets its steps ran on, its own and the padding (`klein.pipeline.warm_buckets.WarmBuckets.
    report`); None over exact sizes or under a step cache."""

    def save(self, path: str | Path = ".", overwrite: bool = False) -> list[Path]:
        """Write the images as PNGs carrying their settings (`GenerationRequest.from_metadata` reads them
        back), as `klein generate` writes them: `path` a file name ending in .png (numbered -0, -1, ... for
        several images) or a folder (fresh names `klein-<time>-<seed>.png`). Nothing existing is replaced
        unless `overwrite`; returns the paths written."""
        if self.settings.request.output_type == "latent":
            raise InputError("latents are not images: save needs output_type 'pil' or 'np'")
        pictures = self.images if isinstance(self.images, list) else images.from_float01(self.images)
        plan = png.plan_outputs(str(path), len(pictures), overwrite, png.PYTHON)
        metadata = [png.png_metadata(self.settings.metadata(i, version())) for i in range(len(pictures))]
        return png.write_images(pictures, plan, metadata, self.seed)
