"""Reading GGUF files (community quantisations of FLUX.2 [klein] and of its Qwen3 text encoder): opened by
their header alone (`klein.io.gguf_header`), each tensor read at its offset when asked for, dequantised to
float32 (`get`) or as stored, rows of quantisation blocks (`GGUFSource.blocks`).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import ml_dtypes
import numpy as np

from klein.errors import CheckpointError
from klein.io import finite
from klein.io.gguf_header import read_header
from klein.io.safetensors import read_rows

_T = gguf.GGMLQuantizationType
SUPPORTED = (
    _T.F32, _T.F16, _T.BF16, _T.Q8_0, _T.Q6_K, _T.Q5_K, _T.Q4_K, _T.Q3_K, _T.Q2_K,
    _T.Q5_1, _T.Q5_0, _T.Q4_1, _T.Q4_0,
)  # fmt: skip
# The tensors read as their floats (as `gguf.quants.dequantize` takes them); any other as its bytes.
_FLOATS = {_T.F32: np.dtype(np.float32), _T.F16: np.dtype(np.float16)}
# The bytes of a block of each quantised type at which a float16 scale starts (llama.cpp's `d`, and `m` or
# `dmin` where the type has one); its other fields are small integers: its values are finite where these are.
_SCALES = {
    _T.Q8_0: (0,), _T.Q4_0: (0,), _T.Q5_0: (0,), _T.Q4_1: (0, 2), _T.Q5_1: (0, 2),
    _T.Q2_K: (80, 82), _T.Q3_K: (108,), _T.Q4_K: (0, 2), _T.Q5_K: (0, 2), _T.Q6_K: (208,),
}  # fmt: skip


class GGUFSource:
    """The tensors of one GGUF file, keyed by name; read like a `TensorSource`."""

    def __init__(self, path: str | Path):
        self._path = Path(path)
        self.header = read_header(self._path)
        for name, kind in self.header.types.items():
            if kind not in SUPPORTED:
                raise CheckpointError(
                    f"{self._path}: tensor '{name}' has GGUF type {kind.name}, which klein does not read "
                    f"(supported: {', '.join(t.name for t in SUPPORTED)})"
                )

    def keys(self) -> set[str]:
        return set(self.header.shapes)

    def file_of(self, key: str) -> Path:
        return self._path

    def shape(self, key: str) -> tuple[int, ...]:
        return self.header.shapes[key]

    def get(self, key: str, rows: slice | None = None) -> np.ndarray:
        """Tensor `key` (or `rows` of its first axis, whole quantisation blocks each) as float32."""
        return gguf.quants.dequantize(self.stored(key, rows), self.header.types[key])

    def stored(self, key: str, rows: slice | None = None) -> np.ndarray:
        """Tensor `key` (or `rows` of its first axis) as stored: a quantised one as uint8 rows of blocks; a
        CheckpointError if a value read, or a block's scale, is NaN or infinite (`klein.io.finite`)."""
        kind = self.header.types[key]
        dtype = _FLOATS.get(kind, np.dtype(np.uint8))
        shape = self.blocks.shape(key) if dtype == np.uint8 else self.header.shapes[key]
        raw = read_rows(self._path, dtype, shape, self.header.offsets[key], rows)
        if kind in _SCALES:
            words = raw.reshape(-1, gguf.GGML_QUANT_SIZES[kind][1]).view(np.uint16)
            finite.checked_scales(
                words[:, [at // 2 for at in _SCALES[kind]]].view(np.float16), self._path, key
            )
        else:  # float values, BF16's as their bytes
            finite.checked(raw.view(ml_dtypes.bfloat16) if kind == _T.BF16 else raw, self._path, key)
        return raw

    @property
    def blocks(self) -> Blocks:
        return Blocks(self)


class Blocks:
    """The quantised tensors of a `GGUFSource` as stored: rows of quantisation blocks, uint8[rows, bytes]."""

    def __init__(self, source: GGUFSource):
        self._source = source

    def shape(self, key: str) -> tuple[int, ...]:
        return self._source.header.stored_shape(key)

    def get(self, key: str, rows: slice | None = None) -> np.ndarray:
        return self._source.stored(key, rows)
