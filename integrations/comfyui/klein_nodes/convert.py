"""ComfyUI's image and mask tensors <-> the PNG bytes `klein serve` takes and answers, and the text inputs
of the nodes -> request fields. No HTTP and no ComfyUI here (numpy, PIL and torch only).

ComfyUI's conventions: an IMAGE is float32[B, H, W, C] in [0, 1] (C = 3); a MASK is float32[B, H, W] (or
[H, W]) in [0, 1] where 1 marks the area to change (LoadImage's mask is 1 - alpha: painted-out, transparent
pixels are 1). klein's: a mask file without transparency is read as grayscale, white (255) repaints and
black keeps; values between blend at the edge as in diffusers (docs/inpainting.md)."""

from __future__ import annotations

import hashlib
import io

import numpy as np
import PIL.Image
import torch


def to_uint8(image: torch.Tensor) -> np.ndarray:
    """One IMAGE [H, W, C] (or a batch's item) -> uint8[H, W, 3], rounded to the nearest level (a value v/255
    comes back as v exactly)."""
    pixels = image.detach().cpu().float().numpy()
    if pixels.ndim != 3 or pixels.shape[-1] not in (1, 3, 4):
        raise ValueError(
            f"an IMAGE must be [H, W, C] per item with C 1, 3 or 4, got shape {tuple(pixels.shape)}"
        )
    pixels = pixels[..., :3] if pixels.shape[-1] != 1 else np.repeat(pixels, 3, axis=-1)
    return np.round(np.clip(pixels, 0.0, 1.0) * 255.0).astype(np.uint8)


def image_pngs(images: torch.Tensor) -> list[bytes]:
    """An IMAGE batch [B, H, W, C] (or one [H, W, C]) -> one RGB PNG per item."""
    batch = images.unsqueeze(0) if images.dim() == 3 else images
    return [_png(PIL.Image.fromarray(to_uint8(item), "RGB")) for item in batch]


def mask_png(mask: torch.Tensor, width: int, height: int) -> bytes:
    """One MASK [H, W] (ComfyUI: 1 = change) -> klein's grayscale PNG (white repaints) of the image's size
    `width` x `height` (klein's HTTP API refuses a mask of another size, as OpenAI's does): a mask of another
    size is resized bilinearly first, as ComfyUI's own nodes resize masks."""
    values = mask.detach().cpu().float()
    if values.dim() == 3 and values.shape[0] == 1:
        values = values[0]
    if values.dim() != 2:
        raise ValueError(f"a MASK must be [H, W] per item, got shape {tuple(values.shape)}")
    if tuple(values.shape) != (height, width):
        values = torch.nn.functional.interpolate(
            values[None, None], size=(height, width), mode="bilinear", align_corners=False
        )[0, 0]
    levels = np.round(np.clip(values.numpy(), 0.0, 1.0) * 255.0).astype(np.uint8)
    return _png(PIL.Image.fromarray(levels, "L"))


def masks_for(masks: torch.Tensor, count: int) -> list[torch.Tensor]:
    """A MASK batch [B, H, W] (or one [H, W]) matched to `count` images: one mask each, or one for all."""
    batch = masks.unsqueeze(0) if masks.dim() == 2 else masks
    if batch.shape[0] not in (1, count):
        raise ValueError(f"{batch.shape[0]} masks for {count} images: give one mask, or one per image")
    return [batch[i if batch.shape[0] > 1 else 0] for i in range(count)]


def images_of(pngs: list[bytes]) -> torch.Tensor:
    """klein's PNGs -> an IMAGE batch float32[B, H, W, 3] in [0, 1] (images of one request share a size)."""
    arrays = [
        np.asarray(PIL.Image.open(io.BytesIO(data)).convert("RGB"), np.float32) / 255.0 for data in pngs
    ]
    return torch.from_numpy(np.stack(arrays))


def set_key(pngs: list[bytes]) -> str:
    """A reference set's identity on the client: the SHA-256 of its images' bytes, in order (klein's ids are
    content-addressed the same way, so equal keys name the same set on the server)."""
    digest = hashlib.sha256()
    for data in pngs:
        digest.update(hashlib.sha256(data).digest())
    return digest.hexdigest()


def loras(text: str) -> list[str]:
    """The `loras` input, "ink:0.8, pen" (commas or new lines between), -> klein's list of "NAME[:SCALE]"
    (the server checks names and scales, and says what it offers: GET /v1/loras)."""
    return [part.strip() for part in text.replace("\n", ",").split(",") if part.strip()]


def size(width: int, height: int) -> str:
    """The `size` field: "WxH", or "auto" (the first reference's) when either side is 0."""
    return "auto" if width <= 0 or height <= 0 else f"{width}x{height}"


def _png(picture: PIL.Image.Image) -> bytes:
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue()
