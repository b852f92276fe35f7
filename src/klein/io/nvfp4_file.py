"""Reading NVFP4 layers of safetensors files: BFL's `flux-2-klein-*-nvfp4.safetensors` and ComfyUI's
mixed-precision files, whose `_quantization_metadata` (`klein.io.fp8`) names a layer's format "nvfp4".

A layer stores `<layer>.weight` uint8[out, in / 2] (two E2M1 values a byte), `<layer>.weight_scale` (its
float8 E4M3 scale per 16 values, swizzled in cuBLAS's tile layout) and `<layer>.weight_scale_2` (float32
per tensor); `klein.models.nvfp4` says what they mean. The transformer keeps them 4-bit: `Blocks` presents
each weight as klein's rows of blocks (the per-tensor scale is read as the Linear's `weight_scale`);
`Values` presents it dequantised to float32, for the layers whose stack is not NVFP4 throughout and for
`dequantize=True`.
"""

from __future__ import annotations

import math

import numpy as np

from klein.errors import CheckpointError
from klein.models import nvfp4

FORMAT = "nvfp4"
SIDE_TENSORS = ("weight_scale", "weight_scale_2", "input_scale", "comfy_quant")
TENSOR_SCALE = "weight_scale_2"
_PACKED, _SCALES = "U8", "F8_E4M3"


def check_layer(source, keys: set[str], layer: str, where: str) -> None:
    """Raise a CheckpointError naming what is wrong with NVFP4 layer `layer` of `source`, if anything."""
    weight, scales, tensor = (f"{layer}.{leaf}" for leaf in ("weight", "weight_scale", TENSOR_SCALE))
    for key in (weight, scales, tensor):
        if key not in keys:
            raise CheckpointError(
                f"{where}: NVFP4 layer '{layer}' has no tensor '{key}' (the header lists it as {FORMAT}); the "
                f"file is incomplete or was written by a tool klein does not know"
            )
    shape = source.shape(weight)
    if source.dtype(weight) != _PACKED or len(shape) != 2 or shape[1] * 2 % nvfp4.BLOCK:
        raise CheckpointError(
            f"{where}: '{weight}' is {source.dtype(weight)} {shape}; an NVFP4 weight is U8 [out, in / 2] with "
            f"in a multiple of {nvfp4.BLOCK}"
        )
    want = nvfp4.swizzled_size(shape[0], shape[1] * 2)
    if source.dtype(scales) != _SCALES or math.prod(source.shape(scales)) != want:
        raise CheckpointError(
            f"{where}: '{scales}' is {source.dtype(scales)} {source.shape(scales)}; klein reads ComfyUI's "
            f"NVFP4 block scales, {_SCALES} in cuBLAS's swizzled layout ({want} values for this weight)"
        )
    if source.shape(tensor) not in ((), (1,)):
        raise CheckpointError(f"{where}: '{tensor}' has shape {source.shape(tensor)}, not a per-tensor scale")


def logical_shape(source, weight: str) -> tuple[int, int]:
    """The [out, in] shape of NVFP4 weight `weight` (stored [out, in / 2])."""
    rows, half = source.shape(weight)
    return rows, half * 2


class Blocks:
    """NVFP4 weights of `source` as klein stores them: uint8[out, in / 16 * 9] rows of blocks."""

    def __init__(self, source):
        self._source = source

    def shape(self, key: str) -> tuple[int, ...]:
        rows, columns = logical_shape(self._source, key)
        return rows, columns // nvfp4.BLOCK * nvfp4.BLOCK_BYTES

    def get(self, key: str, rows: slice | None = None) -> np.ndarray:
        layer = key.removesuffix(".weight")
        blocks = nvfp4.as_blocks(self._source.get(key), self._source.get(f"{layer}.weight_scale"))
        return blocks if rows is None else blocks[rows]


class Values(Blocks):
    """NVFP4 weights of `source` dequantised: float32[out, in], per-tensor scale included."""

    def shape(self, key: str) -> tuple[int, ...]:
        return logical_shape(self._source, key)

    def get(self, key: str, rows: slice | None = None) -> np.ndarray:
        scale = self._source.get(f"{key.removesuffix('.weight')}.{TENSOR_SCALE}").astype(np.float32)
        return nvfp4.dequantise(super().get(key, rows)) * scale.reshape(())
