"""Reading GGUF files (community quantisations of FLUX.2 [klein] for ComfyUI-GGUF and stable-diffusion.cpp,
and of its Qwen3 text encoder: `klein.io.text_encoder_gguf`) with the `gguf` package.

Tensors keep the names they are stored under. Each tensor is dequantised to float32 on the host when the
loader reads it, and the loader casts it to the compute dtype: the transformer then takes the device memory
of an unquantised model of that dtype (klein-9b: 18.2 GB in bf16). GGUF saves disk space and download time,
not device memory. Shapes are reported in PyTorch order (GGUF lists dimensions innermost first).
"""

from __future__ import annotations

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
        tensor = self._tensors[key]
        data = tensor.data if rows is None else tensor.data[rows]
        return gguf.quants.dequantize(np.asarray(data), tensor.tensor_type)
