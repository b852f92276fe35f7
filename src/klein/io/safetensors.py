"""Reading tensors from safetensors checkpoints: one file, or shards listed in a `*.safetensors.index.json`.

Files are memory-mapped; a tensor is read only when asked for, so a loader can stream a checkpoint
one tensor at a time instead of holding it twice in host memory.
"""

from __future__ import annotations

import functools
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
        """Tensor `key`, or only `rows` (a contiguous slice) of its first axis, read from the file into a
        new array. Plain reads, not the memory map: mapped pages would count in the process's resident
        memory until the file is closed, a second copy of the checkpoint while a model loads."""
        path = self._file_of[key]
        try:
            header, data_start = _header(path)
            entry = header[key]
            dtype = np.dtype(_DTYPES[entry["dtype"]])
            shape = list(entry["shape"])
            offset = data_start + entry["data_offsets"][0]
            if rows is not None:
                start, stop, step = rows.indices(shape[0] if shape else 0)
                if step != 1:
                    raise ValueError("rows must be a contiguous slice")
                row = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
                offset, shape[0] = offset + start * row, max(stop - start, 0)
            count = int(np.prod(shape, dtype=np.int64))
            return np.fromfile(path, dtype=dtype, count=count, offset=offset).reshape(shape)
        except (KeyError, OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: cannot read tensor '{key}' ({exc})") from None


# safetensors dtype names -> NumPy dtypes (bfloat16 and float8 from ml_dtypes).
_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def _header(path: Path) -> tuple[dict, int]:
    """(the JSON header, where the data starts): a file is 8 bytes of header length, the header, the data.
    Parsed once per version of the file."""
    stat = path.stat()
    return _parsed(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=256)
def _parsed(path: Path, mtime_ns: int, size: int) -> tuple[dict, int]:
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(size)), 8 + size


def _open(path: Path):
    try:
        return safe_open(str(path), framework="numpy")
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(
            f"{path}: not a readable safetensors file ({exc}); the download may be incomplete"
        ) from None
