"""Weights refused when they hold a NaN or an infinity, checked as each tensor is read.

One NaN weight spreads through every product it takes part in, and the image decodes black (an infinity
makes NaNs of its own): a damaged download, or a LoRA saved from a training run that diverged, would
otherwise give black images and exit 0. Every tensor a reader gives (`klein.io.safetensors.TensorSource`,
`klein.io.gguf_file.GGUFSource`) is checked here once, on the array just read, before anything widens it.

The check looks at each value's exponent bits only (all ones: NaN or infinity), a chunk of the values at a
time: a pass at memory speed, beside a read from the disk or page cache that takes many times longer
(docs/design/checkpoints.md, "Non-finite weights").
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from klein.errors import CheckpointError, counted

# The bits that are all ones in a non-finite value of each float type, and in no finite one: the exponent
# (FP8 E4M3's "fn" form has no infinity, and its NaN alone has exponent and mantissa all ones).
_MASKS = {
    np.dtype(np.float64): 0x7FF0_0000_0000_0000,
    np.dtype(np.float32): 0x7F80_0000,
    np.dtype(np.float16): 0x7C00,
    np.dtype(ml_dtypes.bfloat16): 0x7F80,
    np.dtype(ml_dtypes.float8_e5m2): 0x7C,
    np.dtype(ml_dtypes.float8_e4m3fn): 0x7F,
}
_CHUNK = 1 << 20  # values masked at a time: the masked copy stays in the CPU's caches


def all_finite(array: np.ndarray) -> bool:
    """Whether every value of `array` is finite (an array of integers, bytes or booleans always is)."""
    mask = _MASKS.get(array.dtype)
    if mask is None:
        return True
    bits = np.ascontiguousarray(array).reshape(-1).view(f"u{array.dtype.itemsize}")
    mask = bits.dtype.type(mask)
    masked = np.empty(min(_CHUNK, bits.size), bits.dtype)
    for start in range(0, bits.size, _CHUNK):
        part = masked[: min(_CHUNK, bits.size - start)]
        np.bitwise_and(bits[start : start + _CHUNK], mask, out=part)
        if part.max() == mask:
            return False
    return True


def checked(array: np.ndarray, path, key: str) -> np.ndarray:
    """`array`, tensor `key` of the file at `path`, or a CheckpointError if a value of it is not finite."""
    if not all_finite(array):
        raise CheckpointError(f"{path}: tensor '{key}' {_found(array)}; {_ADVICE}")
    return array


def checked_scales(scales: np.ndarray, path, key: str) -> None:
    """A CheckpointError unless every float16 block scale of tensor `key` of `path` is finite: `scales`
    float16[blocks, scales per block]. Its values are small integers times them, finite where they are."""
    if not all_finite(scales):
        bad = int(np.count_nonzero(~np.isfinite(scales).all(axis=-1)))
        first = int(np.argmin(np.isfinite(scales).all(axis=-1)))
        raise CheckpointError(
            f"{path}: tensor '{key}' has {counted(bad, 'quantisation block')} whose scale is NaN or "
            f"infinite (the first is block {first}), so its values are not finite; {_ADVICE}"
        )


_ADVICE = (
    "a model with NaN or infinite weights draws only black images, so klein does not load it: the file is "
    "damaged (download it again) or was saved from a training run that diverged"
)


def _found(array: np.ndarray) -> str:
    """What is wrong with `array` in words: "holds 2 NaN values and 1 infinite value (the first at [0, 3])"."""
    nan, inf = np.isnan(array), np.isinf(array)
    found = [
        counted(int(n), what) for n, what in ((nan.sum(), "NaN value"), (inf.sum(), "infinite value")) if n
    ]
    first = np.unravel_index(int(np.argmax(nan | inf)), array.shape)
    return f"holds {' and '.join(found)} (the first at {list(map(int, first))})"
