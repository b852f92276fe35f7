"""Test pictures: smooth random images (plain noise would make SSIM meaningless) and soft-edged masks."""

import numpy as np
import PIL.Image
import PIL.ImageDraw
import PIL.ImageFilter


def picture(width, height, seed):
    rng = np.random.default_rng(seed)
    small = rng.uniform(0, 255, (max(2, height // 16), max(2, width // 16), 3)).astype(np.uint8)
    return PIL.Image.fromarray(small).resize((width, height), PIL.Image.BILINEAR)


def ellipse_mask(width, height, box, blur=3.0):
    """White inside the ellipse of `box` (fractions of the size: left, top, right, bottom), black
    outside, the edge softened by a Gaussian blur of `blur` px."""
    mask = PIL.Image.new("L", (width, height), 0)
    left, top, right, bottom = box
    PIL.ImageDraw.Draw(mask).ellipse((left * width, top * height, right * width, bottom * height), fill=255)
    return mask.filter(PIL.ImageFilter.GaussianBlur(blur)) if blur else mask
