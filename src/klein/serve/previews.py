"""A job's live previews (`"preview": true` on POST /v1/jobs): after a denoising step, at most one a
second, the job's event stream gets a "preview" event, its first image as TAEF2 decodes the latents
(`klein.pipeline.preview`), a small JPEG data URL (docs/previews.md, "Over HTTP").

A job keeps its latest frame only: when the next comes, the one before loses its image (null), so that a
long job's events hold one frame however many it sent; a stream that had not sent it yet sends it so."""

from __future__ import annotations

import base64
import io
import time

from klein.errors import KleinError
from klein.io import taef2_checkpoint
from klein.pipeline import preview
from klein.serve import errors

INTERVAL = 1.0
"""Seconds between two frames of a job: a frame costs a TAEF2 decode on the worker's device."""
SIDE = 384
"""The longest side of a frame, in px: enough to see the image form, a few tens of KB a frame."""
QUALITY = 80  # JPEG quality of a frame


def available() -> bool:
    """Whether TAEF2's weights are where the server reads them (GET /v1/config tells the page)."""
    return taef2_checkpoint.default_path().is_file()


def previewer(pipe):
    """The server's TAEF2 (`$KLEIN_HOME/taef2.safetensors`), or a 400 saying why there is none."""
    path = taef2_checkpoint.default_path()
    if not path.is_file():
        raise errors.ApiError(
            400,
            f"this server has no previews: TAEF2's weights are not at {path}; its operator downloads "
            f'{taef2_checkpoint.DOWNLOAD} there (docs/previews.md), or ask without "preview"',
            "invalid_value",
            "preview",
        )
    try:
        return preview.previewer(path, pipe.vae_config.latent_channels)
    except KleinError as error:
        raise errors.ApiError(
            400, f"this server has no previews: {error}", "invalid_value", "preview"
        ) from None


class Frames:
    """The step callback (`Flux2KleinPipeline.generate`'s `on_step_end`) of one job: appends its frames
    to `events`, the job's."""

    def __init__(self, previewer, events: list, clock=time.monotonic):
        self._previewer, self._events, self._clock = previewer, events, clock
        self._last: float | None = None
        self._frame: dict | None = None

    def __call__(self, step: int, timestep: float, latents, grid) -> None:
        now = self._clock()
        if self._last is not None and now - self._last < INTERVAL:
            return
        self._last = now
        image = self._previewer.images(latents[:1], grid)[0]
        image.thumbnail((SIDE, SIDE))
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=QUALITY)
        url = "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
        if self._frame is not None:
            self._frame["image"] = None
        self._frame = {"step": step + 1, "image": url}
        self._events.append(("preview", self._frame))
