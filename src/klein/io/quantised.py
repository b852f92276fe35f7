"""Weights quantised at load for 8-bit products (`compute="fp8" | "int8"`, `klein.models.products`): a Linear
weight is read as `<layer>.weight` in 8 bits and `<layer>.weight_scale` per output channel, both computed as
the stored tensor is read, so the 8-bit model is never held in a wider form beside itself.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from klein.io.mapped import Through, Whole
from klein.models import products

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


def quantised_table(table: dict, kernels: dict[str, str]) -> dict:
    """`table` (key -> piece) with each weight key of `kernels` (-> its compute) read quantised, beside
    its scales under `<layer>.weight_scale`."""
    out = dict(table)
    for key, compute in kernels.items():
        piece = table.get(key, Whole(key))
        out[key] = Quantised(piece, compute)
        out[key.removesuffix(".weight") + SCALE] = ChannelScales(piece, compute)
    return out
