"""Reading, preparing and writing images, matching the diffusers FLUX.2 [klein] pipeline to the pixel.

Axes: B batch, H height, W width (pixels); arrays are channels-last RGB.
"""

import io
import math
import os
import re

import numpy as np
import PIL.Image
import PIL.ImageOps

from klein.errors import InputError
from klein.models.facts import PIXELS_PER_TOKEN

MIN_SIDE = 64
MAX_ASPECT = 8
MAX_AREA = 1024 * 1024
MULTIPLE = PIXELS_PER_TOKEN
"""Prepared sides are multiples of this many px: one transformer token each."""
UPLOAD_FORMATS = ("PNG", "JPEG", "WEBP")
"""What `klein serve` decodes: Pillow tries no other plugin on a client's bytes (EPS's runs Ghostscript,
a PostScript interpreter; the rarer ones are more attack surface than use)."""


def load_image(path: str | os.PathLike) -> PIL.Image.Image:
    """Read an image file, apply its EXIF orientation and convert it to RGB, as `diffusers.utils.load_image`.

    Note that a 16-bit image is clipped at 255 rather than rescaled: that is PIL's conversion, and diffusers'.
    """
    return _read(path, str(path))


def read_image(
    data: bytes,
    name: str,
    max_pixels: int | None = None,
    mode: str | None = "RGB",
    formats: tuple[str, ...] | None = None,
) -> PIL.Image.Image:
    """`load_image` for bytes in memory (an upload, called `name` in errors); an image of more than
    `max_pixels` pixels is refused from its header, before its pixels are decoded (decompression bombs).
    `mode=None` keeps the file's own pixel mode (a mask's alpha channel); `formats`: the only Pillow
    formats tried (None: every one)."""
    return _read(io.BytesIO(data), name, max_pixels, mode, formats)


def show_pixels(count: int) -> str:
    """A pixel count for people: "2048x2048 px" when it is a square's, else megapixels ("16.8 MP")."""
    side = math.isqrt(count)
    return f"{side}x{side} px" if side * side == count else f"{count / 1e6:.1f} MP"


def _read(
    source, name: str, max_pixels: int | None = None, mode: str | None = "RGB", formats=None
) -> PIL.Image.Image:
    try:
        with PIL.Image.open(source, formats=formats) as image:
            if max_pixels is not None and image.width * image.height > max_pixels:
                raise InputError(
                    f"{name} is {image.width}x{image.height} px, more than the {show_pixels(max_pixels)} allowed; "
                    "send a smaller image"
                )
            # open() parses only the header; load() decodes every pixel so a truncated file fails here.
            image.load()
            upright = PIL.ImageOps.exif_transpose(image)
            return upright.convert(mode) if mode else upright
    except FileNotFoundError as error:
        raise InputError(f"image not found: {name}") from error
    except IsADirectoryError as error:
        raise InputError(f"{name} is a directory, not an image file") from error
    except PermissionError as error:
        raise InputError(f"cannot read image {name}: permission denied") from error
    except PIL.UnidentifiedImageError as error:
        if formats:
            accepted = ", ".join(formats[:-1]) + f" or {formats[-1]}"
            raise InputError(f"{name} is not a {accepted} image; send one of those formats") from error
        raise InputError(f"{name} is not an image file (or not a format PIL can read)") from error
    except PIL.Image.DecompressionBombError as error:
        raise InputError(_too_large(name, str(error), max_pixels)) from None
    except (OSError, SyntaxError, ValueError) as error:
        raise InputError(f"{name} is truncated or corrupt ({error})") from error


def _too_large(name: str, pillow_says: str, max_pixels: int | None) -> str:
    """klein's words for an image Pillow's own guard refused as it read the header (past twice
    `PIL.Image.MAX_IMAGE_PIXELS`, before klein's check could see its size): its pixel count, which
    Pillow's message states, and the limit."""
    counted = re.search(r"\((\d+) pixels\)", pillow_says)
    limit = max_pixels or 2 * (PIL.Image.MAX_IMAGE_PIXELS or 0)
    size = f"{show_pixels(int(counted.group(1)))}, more" if counted else "more"
    return f"{name} is {size} than the {show_pixels(limit)} allowed; send a smaller image"


def prepare_reference(image: PIL.Image.Image, name: str = "reference image") -> np.ndarray:
    """One reference image prepared exactly as the diffusers klein pipeline does: float32[H, W, 3] in
    [-1, 1], centre-cropped (not resized) to multiples of 16; `name` (e.g. the file path) for errors."""
    check_shape(image, name, MIN_SIDE)
    if image.width * image.height > MAX_AREA:
        image = resize_to_area(image, MAX_AREA)
    image = image.crop(_centre_crop_box(image.width, image.height))
    try:
        # diffusers converts only after resizing and cropping, so those ran in the image's own mode.
        image = image.convert("RGB")
    except ValueError as error:
        raise InputError(f"{name} has pixel mode {image.mode!r}, which cannot be converted to RGB") from error
    pixels = np.asarray(image, dtype=np.float32) / 255.0
    return 2.0 * pixels - 1.0


def prepare_references(pictures, first: int = 1) -> list[np.ndarray]:
    """Reference images (PIL images or paths) -> float32[H, W, 3] arrays; messages number them from `first`."""
    return [prepare_reference(as_pil(p), f"reference image {i + first}") for i, p in enumerate(pictures)]


def as_pil(image) -> PIL.Image.Image:
    """An image as a request holds it (a PIL image or a path) as a PIL image."""
    return image if isinstance(image, PIL.Image.Image) else load_image(image)


def check_shape(image: PIL.Image.Image, name: str, min_side: int) -> None:
    """An `InputError` for an image with a side under `min_side` px or an aspect ratio past `MAX_ASPECT`:
    resized to the pipeline's area, a longer one would leave a side of no pixels (or of a token's few)."""
    width, height = image.size
    if width < min_side or height < min_side:
        raise InputError(
            f"{name} is {width}x{height} px (width x height); both sides must be at least {min_side} px"
        )
    aspect = max(width / height, height / width)
    if aspect > MAX_ASPECT:
        raise InputError(
            f"{name} is {width}x{height} px (width x height), an aspect ratio of {aspect:.1f}:1; "
            f"the longer side may be at most {MAX_ASPECT} times the shorter"
        )


def resize_to_area(image: PIL.Image.Image, area: int) -> PIL.Image.Image:
    # Truncating with int() (not rounding) and resizing in the source mode both follow diffusers: a palette
    # image therefore resamples NEAREST (PIL's rule for "P") and RGBA resamples with premultiplied alpha.
    scale = math.sqrt(area / (image.width * image.height))
    size = (int(image.width * scale), int(image.height * scale))
    return image.resize(size, PIL.Image.Resampling.LANCZOS)


def _centre_crop_box(width: int, height: int) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of the centred crop to multiples of 16; odd slack leaves the extra pixel
    on the right / bottom."""
    crop_width, crop_height = width // MULTIPLE * MULTIPLE, height // MULTIPLE * MULTIPLE
    left, top = (width - crop_width) // 2, (height - crop_height) // 2
    return left, top, left + crop_width, top + crop_height


def to_float01(images: np.ndarray) -> np.ndarray:
    """float[B, H, W, 3] in [-1, 1] -> float32 in [0, 1], as diffusers' `postprocess(output_type="np")`.

    diffusers denormalises in the decoder's dtype; this works in float32, identical for a float32 decoder.
    """
    return np.clip(np.asarray(images, dtype=np.float32) * 0.5 + 0.5, 0.0, 1.0)


def to_uint8(images: np.ndarray) -> np.ndarray:
    """float[B, H, W, 3] in [-1, 1] -> uint8[B, H, W, 3], the pixels of diffusers' `output_type="pil"`."""
    # np.round rounds half to even, as diffusers does.
    return np.round(to_float01(images) * 255).astype(np.uint8)


def from_float01(images: np.ndarray) -> list[PIL.Image.Image]:
    """float[B, H, W, 3] in [0, 1] (`output_type="np"`) -> B RGB images, rounded as `to_pil` rounds."""
    return to_pil(np.asarray(images, np.float32) * 2 - 1)


def to_pil(images: np.ndarray) -> list[PIL.Image.Image]:
    """float[B, H, W, 3] in [-1, 1] -> B RGB images, as diffusers' `postprocess(output_type="pil")`."""
    pixels = to_uint8(images)
    if pixels.ndim != 4 or pixels.shape[-1] != 3:
        raise ValueError(f"expected images of shape [B, H, W, 3], got {pixels.shape}")
    return [PIL.Image.fromarray(image) for image in pixels]
