"""Inpainting and image-to-image on the host: the source image, the mask and the overlay, prepared exactly
as diffusers' `Flux2KleinInpaintPipeline` prepares them (docs/design.md, "Inpainting").

Axes: H, W the processing size in px (multiples of 16); h = H/16, w = W/16 the token grid.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import PIL.Image
import PIL.ImageOps

from klein import images
from klein.errors import InputError
from klein.images import MULTIPLE as TOKEN  # the latent mask takes one value per 16 x 16 px token
from klein.request.request import MaskLike

ALL_BLACK = "mask_image is all black: nothing to repaint (white marks the area to repaint, black keeps)"


@dataclasses.dataclass(frozen=True)
class Source:
    """The image to repaint, prepared."""

    pixels: np.ndarray
    """float32[H, W, 3] in [-1, 1]: what the VAE encodes (the start of the steps and a reference)."""
    original: PIL.Image.Image
    """The image after the area limit, before any crop or resize: what `overlay` pastes into."""
    crop: tuple[int, int, int, int] | None
    """(left, top, right, bottom) px of the crop repainted with `padding_mask_crop`; None: the whole image."""


def as_mask(mask: MaskLike) -> PIL.Image.Image:
    """A mask as the request holds it -> a PIL image (paths read, arrays of [0, 1] floats or 0-255 ints
    with one channel made an 8-bit grayscale image)."""
    if isinstance(mask, PIL.Image.Image):
        return mask
    if not isinstance(mask, np.ndarray):
        return images.load_image(mask)
    values = mask[..., 0] if mask.ndim == 3 and mask.shape[-1] == 1 else mask
    if values.ndim != 2:
        raise InputError(f"mask_image as an array must be [H, W] or [H, W, 1], got shape {mask.shape}")
    if np.issubdtype(values.dtype, np.floating):
        values = np.round(np.clip(values, 0.0, 1.0) * 255)
    return PIL.Image.fromarray(np.clip(values, 0, 255).astype(np.uint8), "L")


def check_not_black(mask: PIL.Image.Image) -> None:
    """An `InputError` for a mask without one non-black pixel: it repaints nothing at any size, so a front
    end can say so before a model loads (`latent_mask` finds the rest, at the processing size)."""
    if mask.convert("L").getbbox() is None:
        raise InputError(ALL_BLACK)


def other_size(mask: PIL.Image.Image, image: PIL.Image.Image) -> str | None:
    """What is wrong with a mask of another size than the image it repaints, or None: OpenAI's images API
    refuses such a mask, so klein's HTTP API does too (Python and the CLI resize it to the image, as
    diffusers does, and say so in the result's notes)."""
    if mask.size == image.size:
        return None
    return (
        f"the mask is {mask.width}x{mask.height} px but the image to repaint is {image.width}x{image.height} "
        "px (WxH): send a mask of the image's size"
    )


def from_alpha(picture: PIL.Image.Image) -> PIL.Image.Image:
    """OpenAI's mask convention -> klein's: where a picture with transparency is fully transparent is the
    area to repaint (white), everything else black; a picture without transparency is read as a mask
    already (white repaints)."""
    if picture.mode == "P" and "transparency" in picture.info or picture.mode in ("PA", "LA", "RGBA"):
        alpha = np.asarray(picture.convert("RGBA"))[..., 3]
        return PIL.Image.fromarray(np.where(alpha == 0, 255, 0).astype(np.uint8), "L")
    return picture.convert("L")


def prepare_source(
    image: PIL.Image.Image, mask: PIL.Image.Image | None = None, padding_mask_crop: int | None = None
) -> Source:
    """The image to repaint, as diffusers prepares its `image`: more than 1024^2 px of area is resized to
    that area; then the whole image (or, with `padding_mask_crop`, the region around the mask that has the
    image's aspect ratio, grown by that margin) is resized to the image's sides rounded down to multiples
    of 16 and converted to RGB. Sides of at least 16 px, at most `images.MAX_ASPECT` times each other (as a
    reference's): past that, the area's resize leaves a side of no pixels."""
    images.check_shape(image, "the image to repaint", TOKEN)
    if image.width * image.height > images.MAX_AREA:
        image = images.resize_to_area(image, images.MAX_AREA)
    width, height = image.width // TOKEN * TOKEN, image.height // TOKEN * TOKEN
    crop = None
    if padding_mask_crop is not None:
        crop = crop_region(mask, width, height, padding_mask_crop)
        picture = _fill(image.crop(crop), width, height)
    else:
        picture = image.resize((width, height), PIL.Image.Resampling.LANCZOS)
    pixels = np.asarray(picture.convert("RGB"), np.float32) / 255.0
    return Source(2.0 * pixels - 1.0, image, crop)


def latent_mask(
    mask: PIL.Image.Image, size: tuple[int, int], padding_mask_crop: int | None = None
) -> np.ndarray:
    """float32[h*w, 1] for the processing `size` (height, width) px: 1 repaints a token, 0 keeps it, and
    tokens on the mask's edge get 1/4, 1/2 or 3/4 (diffusers samples the binarised mask bilinearly at each
    token's centre, between its four middle pixels). With `padding_mask_crop`, the region `prepare_source`
    crops from the image (`crop_region`) is cropped from the mask too. An `InputError` when nothing is
    left to repaint."""
    height, width = size
    if padding_mask_crop is not None:
        picture = _fill(mask.crop(crop_region(mask, width, height, padding_mask_crop)), width, height)
    else:
        picture = mask.resize((width, height), PIL.Image.Resampling.LANCZOS)
    values = np.asarray(picture.convert("L"), np.float32) / 255.0
    binary = (values >= 0.5).astype(np.float32)
    if not binary.any():
        raise InputError(ALL_BLACK)
    middle = TOKEN // 2
    rows = binary[middle - 1 :: TOKEN] * 0.5 + binary[middle::TOKEN] * 0.5
    tokens = rows[:, middle - 1 :: TOKEN] * 0.5 + rows[:, middle::TOKEN] * 0.5
    return tokens.reshape(-1, 1)


def crop_region(mask: PIL.Image.Image | None, width: int, height: int, pad: int) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) px: the bounding box of the mask's non-black pixels, grown by `pad` on
    each side (within the mask), then grown along one axis to the aspect ratio width : height, kept
    inside the mask's bounds (diffusers' `get_crop_region`)."""
    if mask is None:
        raise InputError("padding_mask_crop needs mask_image: it crops around the masked area")
    values = np.asarray(mask.convert("L"))
    rows, cols = np.flatnonzero(values.any(axis=1)), np.flatnonzero(values.any(axis=0))
    if rows.size == 0:
        raise InputError("mask_image is all black: nothing to repaint (white marks the area to repaint)")
    mask_h, mask_w = values.shape
    x1, y1 = max(int(cols[0]) - pad, 0), max(int(rows[0]) - pad, 0)
    x2, y2 = min(int(cols[-1]) + 1 + pad, mask_w), min(int(rows[-1]) + 1 + pad, mask_h)
    ratio = width / height
    if (x2 - x1) / (y2 - y1) > ratio:
        y1, y2 = _grow(y1, y2, int((x2 - x1) / ratio - (y2 - y1)), mask_h)
    else:
        x1, x2 = _grow(x1, x2, int((y2 - y1) * ratio - (x2 - x1)), mask_w)
    return x1, y1, x2, y2


def _grow(low: int, high: int, extra: int, limit: int) -> tuple[int, int]:
    """Grow [low, high) by `extra`, half before and half after, shifted back inside [0, limit]."""
    low, high = low - extra // 2, high + extra - extra // 2
    if high >= limit:
        low, high = low - (high - limit), limit
    if low < 0:
        low, high = 0, high - low
    return low, min(high, limit)


def _fill(picture: PIL.Image.Image, width: int, height: int) -> PIL.Image.Image:
    """Resize keeping the aspect ratio to fit inside width x height, centred on an RGB canvas, the bands
    left over filled by stretching the picture's edge rows or columns (diffusers' resize mode "fill")."""
    wide = width / height < picture.width / picture.height
    canvas, fitted = _centred(picture, width, height, wide)
    fit_w, fit_h = fitted.size
    if wide:
        band = height // 2 - fit_h // 2
        if band > 0:
            canvas.paste(fitted.resize((width, band), box=(0, 0, width, 0)), box=(0, 0))
            edge = (0, fitted.height, width, fitted.height)
            canvas.paste(fitted.resize((width, band), box=edge), box=(0, band + fit_h))
    elif width / height > picture.width / picture.height:
        band = width // 2 - fit_w // 2
        if band > 0:
            canvas.paste(fitted.resize((band, height), box=(0, 0, 0, height)), box=(0, 0))
            edge = (fitted.width, 0, fitted.width, height)
            canvas.paste(fitted.resize((band, height), box=edge), box=(band + fit_w, 0))
    return canvas


def _centred(picture: PIL.Image.Image, width: int, height: int, full_width: bool):
    """(canvas, fitted): the picture resized keeping its aspect ratio to the canvas's full width (else its
    full height), centred on an RGB canvas of width x height."""
    fit_w = width if full_width else max(picture.width * height // picture.height, 1)
    fit_h = max(picture.height * width // picture.width, 1) if full_width else height
    fitted = picture.resize((fit_w, fit_h), PIL.Image.Resampling.LANCZOS)
    canvas = PIL.Image.new("RGB", (width, height))
    canvas.paste(fitted, box=(width // 2 - fit_w // 2, height // 2 - fit_h // 2))
    return canvas, fitted


def overlay(image: PIL.Image.Image, source: Source, mask: PIL.Image.Image) -> PIL.Image.Image:
    """The repainted crop `image` resized into its place in the original, and the original over it
    wherever the mask is black (soft edges blend): diffusers' `apply_overlay`."""
    original = source.original
    mask = mask.convert("L")
    if mask.size != original.size:
        mask = mask.resize(original.size, PIL.Image.Resampling.LANCZOS)
    kept = PIL.Image.new("RGBa", original.size)
    kept.paste(original.convert("RGBA").convert("RGBa"), mask=PIL.ImageOps.invert(mask))
    left, top, right, bottom = source.crop
    canvas = PIL.Image.new("RGBA", original.size)
    # The crop covers its box, keeping its aspect ratio (diffusers' resize mode "crop").
    width, height = right - left, bottom - top
    canvas.paste(_centred(image, width, height, width / height > image.width / image.height)[0], (left, top))
    result = canvas.convert("RGB").convert("RGBA")
    result.alpha_composite(kept.convert("RGBA"))
    return result.convert("RGB")
