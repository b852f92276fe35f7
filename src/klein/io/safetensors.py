"""Reading tensors from safetensors checkpoints: one file, or shards listed in a `*.safetensors.index.json`.

Files are memory-mapped; a tensor is read only when asked for, so a loader can stream a checkpoint
one tensor at a time instead of holding it twice in host memory.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from klein.errors import CheckpointError
from klein.io import finite, read_buffers
from klein.io.json_file import read_json


class TensorSource:
    """The tensors of one model component, keyed by checkpoint name, across one or more files."""

    def __init__(self, files: dict[str, Path]):
        # files maps each tensor key to the file that holds it.
        self._file_of = files
        self._handles = {path: _open(path) for path in sorted(set(files.values()))}
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
        for key, name in weight_map.items():
            if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
                raise CheckpointError(
                    f"{index}: the weight_map gives {key!r:.80} the shard {name!r:.80}, not a file name "
                    f"in {index.parent}"
                )
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
        """Tensor `key`, or only `rows` of its first axis (`read_rows`); a CheckpointError if a value read
        is NaN or infinite (`klein.io.finite`)."""
        path = self._file_of[key]
        try:
            array = read_rows(path, *_entry(path, key), rows)
        except (KeyError, OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: cannot read tensor '{key}' ({exc})") from None
        return finite.checked(array, path, key)


def read_rows(path: Path, dtype: np.dtype, shape, offset: int, rows: slice | None = None) -> np.ndarray:
    """The array of `dtype` and `shape` at `offset` in `path`, or only `rows` (a contiguous slice) of its
    first axis. Plain reads, not a memory map, whose pages would count in resident memory until closed."""
    shape = list(shape)
    if rows is not None:
        start, stop, step = rows.indices(shape[0] if shape else 0)
        if step != 1:
            raise ValueError("rows must be a contiguous slice")
        offset += start * math.prod(shape[1:]) * dtype.itemsize
        shape[0] = max(stop - start, 0)
    count = math.prod(shape)
    into = read_buffers.read(path, dtype, count, offset)  # a buffer used again, where a reader took one
    if into is not None:
        return into.reshape(shape)
    return np.fromfile(path, dtype=dtype, count=count, offset=offset).reshape(shape)


# safetensors dtype names -> NumPy dtypes (bfloat16 and float8 from ml_dtypes).
DTYPES = {
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


def _entry(path: Path, key: str) -> tuple[np.dtype, list[int], int]:
    """(dtype, shape, where the data starts) of tensor `key` of `path`, as its header says (read again: the
    file may have been replaced since `safe_open` checked it); a ValueError unless all three are sound."""
    stat = path.stat()
    header, start = _parsed(path, stat.st_mtime_ns, stat.st_size)
    entry = header.get(key)
    if not isinstance(entry, dict):
        raise ValueError("the header does not describe it")
    name, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(name, str) or name not in DTYPES:
        raise ValueError(f"dtype {name!r:.40}, which klein does not read (it reads {', '.join(DTYPES)})")
    dtype = np.dtype(DTYPES[name])
    if not _naturals(shape, None) or not _naturals(offsets, 2) or offsets[0] > offsets[1]:
        raise ValueError(f"a shape {shape!r:.60} and offsets {offsets!r:.60} that the header cannot have")
    if offsets[1] - offsets[0] != math.prod(shape) * dtype.itemsize or start + offsets[1] > stat.st_size:
        raise ValueError(f"offsets {offsets} that do not hold its {shape} {name} inside the file")
    return dtype, list(shape), start + offsets[0]


def _naturals(value, length: int | None) -> bool:
    """Whether `value` is a list of non-negative integers (of `length` of them, unless None)."""
    return (
        isinstance(value, list)
        and (length is None or len(value) == length)
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value)
    )


@functools.lru_cache(maxsize=256)
def _parsed(path: Path, mtime_ns: int, size: int) -> tuple[dict, int]:
    """(the JSON header, where the data starts): a file is 8 bytes of header length, the header, the data.
    Parsed once per version of the file."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if length > size - 8:
            raise ValueError(f"a header of {length} bytes in a file of {size}")
        try:
            header = json.loads(f.read(length))
        except RecursionError:
            raise ValueError("a header nested too deep to be one") from None
    if not isinstance(header, dict):
        raise ValueError("a header that is not a JSON object")
    return header, 8 + length


def _open(path: Path):
    try:
        return safe_open(str(path), framework="numpy")
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(
            f"{path}: not a readable safetensors file ({exc}); the download may be incomplete"
        ) from None
