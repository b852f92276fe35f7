"""Reading NVFP4 layers of safetensors files, in the two layouts they are published in: ComfyUI's (declared
layers, block scales swizzled in cuBLAS's 128 x 4 tiles) and NVIDIA ModelOpt's (nothing declared, row-major
scales); the declaration, not the scales' size, tells them apart (docs/design/checkpoints.md).
"""

from __future__ import annotations

import math

import numpy as np

from klein.errors import CheckpointError
from klein.io import comfy_quant
from klein.models import nvfp4

FORMAT = "nvfp4"
SIDE_TENSORS = ("weight_scale", "weight_scale_2", "input_scale", "comfy_quant")
TENSOR_SCALE = "weight_scale_2"
_PACKED, _SCALES = "U8", "F8_E4M3"


def modelopt_layers(source) -> dict[str, str]:
    """Stored layer names -> FORMAT of the NVFP4 layers of a file in ModelOpt's layout: none where the file
    declares its layers as ComfyUI does, else each layer with a per-tensor `weight_scale_2` (NVFP4's alone)."""
    if comfy_quant.declares_any(source):
        return {}
    suffix = f".{TENSOR_SCALE}"
    return {key.removesuffix(suffix): FORMAT for key in source.keys() if key.endswith(suffix)}


def check_layer(source, keys: set[str], layer: str, where: str) -> None:
    """Raise a CheckpointError naming what is wrong with NVFP4 layer `layer` of `source`, if anything."""
    weight, scales, tensor = (f"{layer}.{leaf}" for leaf in ("weight", "weight_scale", TENSOR_SCALE))
    for key in (weight, scales, tensor):
        if key not in keys:
            raise CheckpointError(
                f"{where}: NVFP4 layer '{layer}' has no tensor '{key}'; the file is incomplete or was written "
                f"by a tool klein does not know"
            )
    shape = source.shape(weight)
    if source.dtype(weight) != _PACKED or len(shape) != 2 or shape[1] * 2 % nvfp4.BLOCK:
        raise CheckpointError(
            f"{where}: '{weight}' is {source.dtype(weight)} {shape}; an NVFP4 weight is U8 [out, in / 2] with "
            f"in a multiple of {nvfp4.BLOCK}"
        )
    if source.dtype(scales) != _SCALES:
        raise CheckpointError(
            f"{where}: '{scales}' is {source.dtype(scales)}, not NVFP4's {_SCALES} block scales"
        )
    _check_scales(source, scales, shape[0], shape[1] * 2, where)
    if source.shape(tensor) not in ((), (1,)):
        raise CheckpointError(f"{where}: '{tensor}' has shape {source.shape(tensor)}, not a per-tensor scale")


def _check_scales(source, scales: str, rows: int, columns: int, where: str) -> None:
    found, row_major = source.shape(scales), (rows, columns // nvfp4.BLOCK)
    if not comfy_quant.declares_any(source):
        if tuple(found) != row_major:
            raise CheckpointError(
                f"{where}: '{scales}' has shape {found}; a file that does not declare its layers in ComfyUI's "
                f"{comfy_quant.HEADER_KEY} is read in NVIDIA ModelOpt's layout, whose block scales are "
                f"[out, in / 16] = {row_major}: declare the layers or export the file with ModelOpt"
            )
        return
    want = nvfp4.swizzled_size(rows, columns)
    if math.prod(found) != want:
        layout = (
            "ModelOpt's row-major [out, in / 16] layout"
            if tuple(found) == row_major
            else "no layout klein knows"
        )
        raise CheckpointError(
            f"{where}: '{scales}' is {found}, {layout}; the file declares its layers as ComfyUI does, whose "
            f"NVFP4 block scales are swizzled in cuBLAS's 128 x 4 tiles ({want} values for this weight): "
            f"post-process the ModelOpt export for ComfyUI, or leave its {comfy_quant.HEADER_KEY} out"
        )


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
        packed = self._source.get(key)
        scales = self._source.get(f"{key.removesuffix('.weight')}.weight_scale")
        layout = nvfp4.as_blocks if comfy_quant.declares_any(self._source) else _row_major_blocks
        blocks = layout(packed, scales)
        return blocks if rows is None else blocks[rows]


def _row_major_blocks(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """klein's rows of blocks from a ModelOpt layer: its nibbles swapped into the high-first order of
    `klein.models.nvfp4`, each block's row-major scale after its 8 bytes."""
    rows, half = packed.shape
    swapped = (packed << np.uint8(4)) | (packed >> np.uint8(4))
    values = swapped.reshape(rows, half * 2 // nvfp4.BLOCK, nvfp4.BLOCK // 2)
    return np.concatenate([values, scales.view(np.uint8)[..., None]], axis=-1).reshape(rows, -1)


class Values(Blocks):
    """NVFP4 weights of `source` dequantised: float32[out, in], per-tensor scale included."""

    def shape(self, key: str) -> tuple[int, ...]:
        return logical_shape(self._source, key)

    def get(self, key: str, rows: slice | None = None) -> np.ndarray:
        scale = self._source.get(f"{key.removesuffix('.weight')}.{TENSOR_SCALE}").astype(np.float32)
        return nvfp4.dequantise(super().get(key, rows)) * scale.reshape(())
