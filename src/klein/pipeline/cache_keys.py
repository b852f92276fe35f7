"""The key of every cache, built in one function each from everything that changes what it holds.

A key that leaves out one input lets two different values share an entry: an orange 512x384 image and an
orange 384x512 one have the same pixel bytes, so a key of bytes alone answers one with the other's
latents. Keys carry their owner (`klein serve`: API keys share no entry, so none can see another's) and
the `weights_id` of what depends on the transformer's weights, unmerged LoRAs included.
"""

from __future__ import annotations

import hashlib

import numpy as np

REFERENCE = "reference"
"""A reference image's preparation: centre-cropped to multiples of 16 px (`klein.images.prepare_reference`)."""
SOURCE = "source"
"""An image to repaint: resized to multiples of 16 px (`klein.masks.prepare_source`)."""


def image_digest(pixels: np.ndarray, preparation: str) -> str:
    """SHA-256 of a prepared image: how it was prepared, its shape and dtype, then its bytes."""
    pixels = np.ascontiguousarray(pixels)
    digest = hashlib.sha256(f"{preparation}|{pixels.dtype.str}|{pixels.shape}|".encode())
    digest.update(pixels.tobytes())
    return digest.hexdigest()


def set_id(digests: tuple[str, ...]) -> str:
    return hashlib.sha256("|".join(digests).encode()).hexdigest()[:32]


def latents_key(digest: str, model_id: str, owner: str | None = None) -> tuple:
    return ("latents", owner, digest, model_id)


def set_key(digests: tuple[str, ...], weights_id: str, cached: bool, owner: str | None = None) -> tuple:
    return ("set", owner, digests, weights_id, cached)


def of_set(key, digests: tuple[str, ...], owner: str | None = None) -> bool:
    """Whether `key` is a `set_key` of these images and owner, under any weights (any LoRAs)."""
    return isinstance(key, tuple) and key[:3] == ("set", owner, digests)


def prompt_key(weights_id: str, prompt: str, owner: str | None = None) -> tuple:
    return ("prompt", owner, weights_id, prompt)


def adapted_weights_id(weights_id: str, adapters: tuple[tuple[str, float], ...]) -> str:
    """`weights_id` with unmerged LoRAs applied: (sha256 of the file, strength) each, in any order; the
    same id without any (a request without LoRAs runs under the weights as they are)."""
    return weights_id + "".join(f"|adapter:{sha}:{scale!r}" for sha, scale in sorted(adapters))
