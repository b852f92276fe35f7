"""The VAE on a canvas: an image of h x w px run at the top left of a larger canvas (a warm program's
size), so that one program serves every size it holds (docs/design/compiling.md, "Warm buckets first").

The padding is masked layer by layer, so that each real pixel's output is the one of the image's own size
up to float rounding: every 3x3 convolution reads zeros beyond the image's border (its input is zeroed
there, as a convolution at the image's size pads with zeros), every GroupNorm takes its statistics over the
image's pixels only, and the mid-block attention's keys of padding rank `MASKED`. The extent is data
(traced), so the sizes a canvas holds share its program. Outside `on_canvas` every function here is a
no-op: the VAE runs as it did.

`canvas_size` is the canvas an image's own size runs on: its height and width rounded up to a few size
classes, so that the photo sizes of a class share one program (docs/design/compiling.md, "Canvas
classes").
"""

from __future__ import annotations

import contextlib
import contextvars

import jax.numpy as jnp

from klein.models.attention import MASKED

CANVAS_STEP = 64
"""px: a canvas's sides are multiples of this (beyond 1024 px, of an eighth of the power of two below them)."""

_CANVAS: contextvars.ContextVar = contextvars.ContextVar("klein_vae_canvas", default=None)


def canvas_side(pixels: int) -> int:
    """The canvas side that a side of `pixels` px runs on: rounded up to a multiple of `CANVAS_STEP` (64 px)
    up to 1024, beyond to a multiple of an eighth of the power of two below it (128 px up to 2048, 256 up
    to 4096...): at most 63 px of padding up to 1024, at most an eighth of the side beyond 512."""
    step = max(CANVAS_STEP, (1 << (max(pixels, 1) - 1).bit_length()) // 16)
    return -(-pixels // step) * step


def canvas_size(height: int, width: int) -> tuple[int, int]:
    """(height, width) px of the canvas an image of `height` x `width` px runs on (`canvas_side` of each)."""
    return canvas_side(height), canvas_side(width)


@contextlib.contextmanager
def on_canvas(extent, height: int):
    """Inside (while tracing), the VAE's layers see an image of `extent` (int32[2]: its height and width
    in px) at the top left of a canvas `height` px tall."""
    token = _CANVAS.set((jnp.asarray(extent, jnp.int32), height))
    try:
        yield
    finally:
        _CANVAS.reset(token)


def real(x):
    """bool[Y, X]: the pixels of x float[B, Y, X, C] (an activation at any of the VAE's resolutions) that
    lie on the image; None off a canvas."""
    canvas = _CANVAS.get()
    if canvas is None:
        return None
    extent, height = canvas
    rows = jnp.arange(x.shape[1]) < extent[0] * x.shape[1] // height
    columns = jnp.arange(x.shape[2]) < extent[1] * x.shape[1] // height
    return rows[:, None] & columns[None, :]


def zeroed(x):
    """x with zeros beyond the image (what the next convolution reads there)."""
    mask = real(x)
    return x if mask is None else jnp.where(mask[None, :, :, None], x, jnp.zeros((), x.dtype))


def weights(x):
    """float32[1, Y * X, 1]: 1 for the image's pixels, 0 beyond (a GroupNorm's statistics); None off a
    canvas."""
    mask = real(x)
    return None if mask is None else mask.reshape(1, -1, 1).astype(jnp.float32)


def key_rank(x):
    """int32[1, Y * X]: attention's key ranks, `MASKED` beyond the image; None off a canvas."""
    mask = real(x)
    return None if mask is None else jnp.where(mask.reshape(1, -1), 0, MASKED).astype(jnp.int32)
