"""Token buckets: the sizes the transformer's programs are compiled for, so that a photo of a new size
reuses a program built for another (docs/design/compiling.md, "Token buckets").

A stream of n tokens (an image's, or all references' together) is padded with masked tokens up to the
smallest bucket of at least n. Buckets keep the two bits after the leading one: 4, 5, 6 or 7 times a power
of two (1024, 1280, 1536, 1792, 2048, 2560, ...), at least `STEP` apart. A bucket is at most a quarter
above what it holds and about a tenth on average; the common sizes (512^2, 768x512, 1024x768, 1024^2,
1536x1024) are buckets themselves. Host arithmetic: no device.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from klein.models.attention import MASKED

STEP = 16
"""The finest spacing of buckets, in tokens (a 64 x 64 px square): small streams are multiples of it."""


def size(tokens: int) -> int:
    """The bucket of a stream of `tokens` tokens (0 for none)."""
    if tokens <= 0:
        return 0
    step = max(STEP, 2 ** ((tokens - 1).bit_length() - 3))
    return -(-tokens // step) * step


def ladder(largest: int) -> list[int]:
    """Every bucket up to the one of `largest` tokens, in order: the stream sizes a warm-up compiles."""
    out, tokens = [], 1
    while tokens <= largest:
        out.append(size(tokens))
        tokens = out[-1] + 1
    return out


def ranks(real: int, padded: int) -> np.ndarray:
    """int32[padded]: 0 for the `real` tokens, `MASKED` for the padding after them."""
    return np.where(np.arange(padded) < real, 0, MASKED).astype(np.int32)


def pad(array: np.ndarray, padded: int, axis: int = 0) -> np.ndarray:
    """`array` with zeros appended along `axis` up to `padded` entries."""
    widths = [(0, 0)] * array.ndim
    widths[axis] = (0, padded - array.shape[axis])
    return np.pad(array, widths)


class Streams(NamedTuple):
    """The tokens the transformer's programs run over: the image's and all references' together, each its
    bucket, or its own count when a request asks for its exact size (`bucket=False`)."""

    image: int
    references: int
    masked: bool
    """Whether the streams are bucketed: their ranks are then data, whether or not a token is padding, so
    that every size of a bucket runs one program."""

    @classmethod
    def of(cls, image: int, references: int, bucket: bool) -> Streams:
        """The streams of `image` and `references` tokens, bucketed if `bucket`."""
        if not bucket:
            return cls(image, references, False)
        return cls(size(image), size(references), True)
