"""Reading GGUF files (community quantisations of FLUX.2 [klein] for ComfyUI-GGUF and stable-diffusion.cpp,
and of its Qwen3 text encoder: `klein.io.text_encoder_gguf`) with the `gguf` package.

Tensors keep the names they are stored under. `get` dequantises a tensor to float32 on the host (F32 /
F16 / BF16 ones, and every tensor where the weights are widened at load); `GGUFSource.blocks` reads a
quantised tensor as it is stored, rows of blocks uint8[rows, bytes], which the transformer keeps in memory
and widens one layer at a time inside its products (`klein.models.gguf_blocks`): a Q4_K klein-9b holds
~5 GB of weights, not 18.
Shapes are reported in PyTorch order (GGUF lists dimensions innermost first).
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np

from klein.errors import CheckpointError

_T = gguf.GGMLQuantizationType
SUPPORTED = (
    _T.F32, _T.F16, _T.BF16, _T.Q8_0, _T.Q6_K, _T.Q5_K, _T.Q4_K, _T.Q3_K, _T.Q2_K,
    _T.Q5_1, _T.Q5_0, _T.Q4_1, _T.Q4_0,
)  # fmt: skip


class GGUFSource:
    """The tensors of one GGUF file, keyed by name; read like a `TensorSource`."""

    def __init__(self, path: str | Path):
        self._path = Path(path)
        try:
            reader = gguf.GGUFReader(self._path)
        except (ValueError, OSError, KeyError, IndexError) as exc:
            raise CheckpointError(
                f"{self._path}: not a readable GGUF file ({exc}); the download may be incomplete, or a tensor "
                f"type is newer than the installed gguf package"
            ) from None
        self._tensors = {tensor.name: tensor for tensor in reader.tensors}
        for tensor in reader.tensors:
            if tensor.tensor_type not in SUPPORTED:
                raise CheckpointError(
                    f"{self._path}: tensor '{tensor.name}' has GGUF type {tensor.tensor_type.name}, which klein "
                    f"does not read (supported: {', '.join(t.name for t in SUPPORTED)})"
                )

    def keys(self) -> set[str]:
        return set(self._tensors)

    def file_of(self, key: str) -> Path:
        return self._path

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(int(n) for n in reversed(self._tensors[key].shape))

    def get(self, key: str, rows: slice | None = None) -> np.ndarray:
        """Tensor `key` (or `rows` of its first axis, whole quantisation blocks each) as float32."""
        return gguf.quants.dequantize(self.stored(key, rows), self._tensors[key].tensor_type)

    def stored(self, key: str, rows: slice | None = None) -> np.ndarray:
        """Tensor `key` (or `rows` of its first axis) as stored (a quantised one: uint8 rows of blocks), read
        from the file: the pages of gguf's memory map would stay in the process's resident memory until the
        file is closed, as much again as the weights read (1.8 GB more at the peak of a Qwen3-4B load)."""
        tensor = self._tensors[key]
        shape, dtype = tensor.data.shape, tensor.data.dtype
        start, stop, _ = (rows or slice(None)).indices(shape[0])
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        offset = int(tensor.data_offset) + start * row_bytes
        data = np.fromfile(self._path, np.uint8, count=(stop - start) * row_bytes, offset=offset)
        return data.view(dtype).reshape(stop - start, *shape[1:])

    def type_name(self, key: str) -> str:
        """The ggml type of tensor `key` (`gguf.GGMLQuantizationType` name: F16, Q4_K, ...)."""
        return self._tensors[key].tensor_type.name

    @property
    def blocks(self) -> Blocks:
        return Blocks(self)


class Blocks:
    """The quantised tensors of a `GGUFSource` as stored: rows of quantisation blocks, uint8[rows, bytes]."""

    def __init__(self, source: GGUFSource):
        self._source = source

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._source._tensors[key].data.shape)

    def get(self, key: str, rows: slice | None = None) -> np.ndarray:
        return self._source.stored(key, rows)
