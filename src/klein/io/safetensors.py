"""Reading tensors from safetensors checkpoints: one file, or shards listed in a `*.safetensors.index.json`.

Files are memory-mapped; a tensor is read only when asked for, so a loader can stream a checkpoint
one tensor at a time instead of holding it twice in host memory.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from klein.errors import CheckpointError
from klein.io.json_file import read_json


class TensorSource:
    """The tensors of one model component, keyed by checkpoint name, across one or more files."""

    def __init__(self, files: dict[str, Path]):
        # files maps each tensor key to the file that holds it.
        self._file_of = files
        self._handles: dict[Path, object] = {}
        for path in sorted(set(files.values())):
            self._handles[path] = _open(path)
        for key, path in files.items():
            if key not in self._handles[path].keys():
                raise CheckpointError(f"{path}: the index lists tensor '{key}' but the file does not hold it")

    @classmethod
    def from_folder(cls, folder: str | Path, prefix: str) -> TensorSource:
        """Open `<folder>/<prefix>.safetensors`, or the shards named by `<prefix>.safetensors.index.json`."""
        folder = Path(folder)
        single = folder / f"{prefix}.safetensors"
        index = folder / f"{prefix}.safetensors.index.json"
        if index.is_file():
            return cls.from_index(index)
        if single.is_file():
            return cls.from_file(single)
        raise CheckpointError(
            f"{folder}: found neither {single.name} nor {index.name}; is this the right checkpoint folder?"
        )

    @classmethod
    def from_file(cls, path: str | Path) -> TensorSource:
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"{path}: no such checkpoint file")
        return cls({key: path for key in _open(path).keys()})

    @classmethod
    def from_index(cls, index: str | Path) -> TensorSource:
        index = Path(index)
        weight_map = read_json(index, "the safetensors index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: not a safetensors index (no weight_map object)")
        files = {key: index.parent / name for key, name in weight_map.items()}
        for path in sorted(set(files.values())):
            if not path.is_file():
                raise CheckpointError(f"{index}: shard {path.name} is missing from {index.parent}")
        return cls(files)

    def keys(self) -> set[str]:
        return set(self._file_of)

    def file_of(self, key: str) -> Path:
        return self._file_of[key]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handles[self._file_of[key]].get_slice(key).get_shape())

    def dtype(self, key: str) -> str:
        """The safetensors dtype name, e.g. "BF16" or "F8_E4M3"."""
        return self._handles[self._file_of[key]].get_slice(key).get_dtype()

    def metadata(self) -> dict[str, str]:
        """The `__metadata__` strings of the header(s), merged over shards."""
        merged: dict[str, str] = {}
        for handle in self._handles.values():
            merged.update(handle.metadata() or {})
        return merged

    def get(self, key: str, rows: slice | None = None) -> np.ndarray:
        """Tensor `key`, or only `rows` of its first axis (read without the rest: parts of fused tensors)."""
        path = self._file_of[key]
        try:
            if self.dtype(key) in _FLOAT8:
                whole = _float8_view(path, key, _FLOAT8[self.dtype(key)])
                return np.array(whole if rows is None else whole[rows])
            if rows is None:
                return self._handles[path].get_tensor(key)
            return self._handles[path].get_slice(key)[rows]
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: cannot read tensor '{key}' ({exc})") from None


# safetensors' numpy reader has no float8 types (numpy itself has none); these are read from the file directly.
_FLOAT8 = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


def _float8_view(path: Path, key: str, dtype) -> np.ndarray:
    """Memory-mapped tensor: the file is 8 bytes of header length, the JSON header, then the data."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        entry = json.loads(f.read(size))[key]
    offset = 8 + size + entry["data_offsets"][0]
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=tuple(entry["shape"]))


def _open(path: Path):
    try:
        return safe_open(str(path), framework="numpy")
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(
            f"{path}: not a readable safetensors file ({exc}); the download may be incomplete"
        ) from None
