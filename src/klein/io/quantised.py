"""Weights quantised at load for 8-bit products (`compute="fp8" | "int8"`, `klein.models.products`): a Linear
weight is read as `<layer>.weight` in 8 bits and `<layer>.weight_scale` per output channel, both computed as
the stored tensor is read, so the 8-bit model is never held in a wider form beside itself. For block-scaled
products (`compute="nvfp4" | "mxfp8"`) `<layer>.weight` is its rows of blocks (`klein.models.block_scaled`),
and NVFP4's `<layer>.weight_scale` its scale per tensor. A text encoder's Linears may be quantised at load into
ggml's blocks (`GgmlBlocks`: Q8_0, Q4_0), as a GGUF file would hold them.
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np

from klein.io.mapped import Through, Whole
from klein.models import block_scaled, products

SCALE = ".weight_scale"


@dataclasses.dataclass(frozen=True)
class Quantised(Through):
    """`piece` (a weight float[out, in]) quantised per output channel for `compute`."""

    compute: str

    def read(self, source) -> np.ndarray:
        return products.quantise(np.asarray(self.piece.read(source)), self.compute, 1)[0]


@dataclasses.dataclass(frozen=True)
class ChannelScales(Quantised):
    """The float32[out] scales `Quantised` divides `piece` by."""

    def shape(self, source) -> tuple[int, ...]:
        return self.piece.shape(source)[:1]

    def read(self, source) -> np.ndarray:
        return products.scales_of(np.asarray(self.piece.read(source)), self.compute, 1)[:, 0]


@dataclasses.dataclass(frozen=True)
class BlockRows(Through):
    """`piece` (a weight float[out, in]) as rows of blocks of the block-scaled `compute`."""

    compute: str

    def shape(self, source) -> tuple[int, ...]:
        rows, columns = self.piece.shape(source)
        return rows, products.packed_width(self.compute, columns)

    def read(self, source) -> np.ndarray:
        return block_scaled.rows_of_blocks(np.asarray(self.piece.read(source)), self.compute)[0]


@dataclasses.dataclass(frozen=True)
class TensorScale(BlockRows):
    """The float32[] scale per tensor `BlockRows`'s blocks are relative to (NVFP4's)."""

    def shape(self, source) -> tuple[int, ...]:
        return ()

    def read(self, source) -> np.ndarray:
        return np.asarray(block_scaled.tensor_scale(np.asarray(self.piece.read(source)), self.compute))


@dataclasses.dataclass(frozen=True)
class GgmlBlocks(Through):
    """`piece` (a weight float[out, in]) as rows of ggml quantisation blocks of type `blocks` (`Q8_0`, `Q4_0`:
    32 values and a float16 scale a block), uint8[out, bytes], made by the `gguf` package's own quantiser
    (llama.cpp's definition): the bytes a GGUF file of that type holds, widened inside each product."""

    blocks: str

    def shape(self, source) -> tuple[int, ...]:
        rows, columns = self.piece.shape(source)
        return rows, products.packed_width(self.blocks, columns)

    def read(self, source) -> np.ndarray:
        weight = np.asarray(self.piece.read(source), np.float32)
        return gguf.quants.quantize(weight, gguf.GGMLQuantizationType[self.blocks])


def quantised_table(table: dict, kernels: dict[str, str]) -> dict:
    """`table` (key -> piece) with each weight key of `kernels` (-> its compute) read quantised, beside
    its scales under `<layer>.weight_scale` (none for MXFP8, whose blocks hold all theirs)."""
    out = dict(table)
    for key, compute in kernels.items():
        piece = table.get(key, Whole(key))
        scale = key.removesuffix(".weight") + SCALE
        if compute in products.BLOCK_SCALED:
            out[key] = BlockRows(piece, compute)
            if block_scaled.FORMATS[compute].tensor_scale:
                out[scale] = TensorScale(piece, compute)
        else:
            out[key] = Quantised(piece, compute)
            out[scale] = ChannelScales(piece, compute)
    return out
