"""A GGUF file's header: its metadata and the names, shapes, types and data offsets of its tensors.

Read with `struct`: `gguf.GGUFReader` takes 16.9 s for Qwen3's vocabulary (0.7 s here). Every count, length
and offset is checked before it is used: a damaged or hostile header is a `CheckpointError` naming the file.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import mmap
import struct
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

from klein.errors import CheckpointError

_V = gguf.GGUFValueType
_SCALARS = {
    _V.UINT8: "<B", _V.INT8: "<b", _V.UINT16: "<H", _V.INT16: "<h", _V.UINT32: "<I", _V.INT32: "<i",
    _V.FLOAT32: "<f", _V.BOOL: "<?", _V.UINT64: "<Q", _V.INT64: "<q", _V.FLOAT64: "<d",
}  # fmt: skip
# The fewest bytes a value of each type takes (a string: its length; an array: its type and count).
_SMALLEST = {**{kind: struct.calcsize(fmt) for kind, fmt in _SCALARS.items()}, _V.STRING: 8, _V.ARRAY: 12}
MAX_DEPTH = 8
"""Arrays of arrays nest at most this deep (llama.cpp reads none; gguf's writer can write them)."""
MAX_DIMS = 4
"""Dimensions of a tensor at most (ggml's GGML_MAX_DIMS)."""
_KV_BYTES, _TENSOR_BYTES = 8 + 4 + 1, 8 + 4 + 8 + 4 + 8  # the smallest metadata entry and tensor info


@dataclasses.dataclass(frozen=True)
class Header:
    """What a GGUF says about itself before its tensor data."""

    path: Path
    metadata: dict
    """Each key's value: a number, string, or list of them."""
    shapes: dict[str, tuple[int, ...]]
    """Each tensor's shape in PyTorch order (outermost first)."""
    types: dict[str, gguf.GGMLQuantizationType]
    offsets: dict[str, int]
    """Where each tensor's data starts in the file."""

    def stored_shape(self, name: str) -> tuple[int, ...]:
        """Tensor `name` as stored: its shape for a float type, else rows of blocks [..., bytes per row]."""
        *lead, width = self.shapes[name]
        values, size = gguf.GGML_QUANT_SIZES[self.types[name]]
        return (*lead, width // values * size)

    def nbytes(self, name: str) -> int:
        """Bytes tensor `name` takes in the file."""
        return _nbytes(self.shapes[name], self.types[name])

    def integer(self, key: str, default: int | None = None) -> int | None:
        """Metadata `key` as an integer (of any GGUF integer type); `default` if absent."""
        return self._typed(key, default, "an integer", _is_integer)

    def number(self, key: str, default: float | None = None) -> float | None:
        """Metadata `key` as a number (integer or float); `default` if absent."""
        return self._typed(key, default, "a number", _is_number)

    def text(self, key: str, default: str | None = None) -> str | None:
        """Metadata `key` as a string; `default` if absent."""
        return self._typed(key, default, "a string", lambda value: isinstance(value, str))

    def strings(self, key: str) -> list[str] | None:
        """Metadata `key` as an array of strings; None if absent."""
        return self._typed(key, None, "an array of strings", _all(lambda item: isinstance(item, str)))

    def integers(self, key: str) -> list[int] | None:
        """Metadata `key` as an array of integers; None if absent."""
        return self._typed(key, None, "an array of integers", _all(_is_integer))

    def _typed(self, key: str, default, what: str, check: Callable[[object], bool]):
        value = self.metadata.get(key, default)
        if value is not None and not check(value):
            raise CheckpointError(f"{self.path}: GGUF metadata {key!r} is {_kind(value)}, not {what}")
        return value


def read_header(path: str | Path) -> Header:
    """The header of the GGUF at `path`; a CheckpointError for a file not one, cut short or malformed."""
    path = Path(path)
    try:
        with path.open("rb") as file:
            size = path.stat().st_size
            if size < 24:
                raise _Malformed(f"{size} bytes, too short for a GGUF header")
            with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return _Reader(data).header(path)
    except _CutShort as exc:
        raise CheckpointError(f"{path}: cut short ({exc}): the download is incomplete") from None
    except _Malformed as exc:
        raise CheckpointError(f"{path}: not a readable GGUF file ({exc})") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read the GGUF file ({exc.strerror or exc})") from None


class _Malformed(ValueError):
    """The header says something impossible, or runs past the end of the file."""


class _CutShort(_Malformed):
    """The tensor data runs past the end of the file."""


class _Reader:
    """Reads a header front to back, each item checked against the bytes left in the file."""

    def __init__(self, data):
        self.data, self.offset = data, 0

    def header(self, path: Path) -> Header:
        magic, version = self.unpack("<II")
        if magic != gguf.GGUF_MAGIC or version not in (2, 3):
            raise _Malformed(
                f"magic {magic:#x}, version {version}: not a little-endian GGUF of version 2 or 3"
            )
        tensors, count = self.unpack("<QQ")
        metadata = {}
        for _ in range(self.count(count, _KV_BYTES, "metadata entries")):
            key = self.string()
            if key in metadata:
                raise _Malformed(f"metadata key {key!r} appears twice")
            metadata[key] = self.value(self.kind(f"metadata {key!r}"), f"metadata {key!r}")
        alignment = metadata.get(gguf.Keys.General.ALIGNMENT, gguf.GGUF_DEFAULT_ALIGNMENT)
        if not _is_integer(alignment) or alignment < 1 or alignment & (alignment - 1):
            raise _Malformed(f"{gguf.Keys.General.ALIGNMENT} is {alignment!r}, not a positive power of two")
        shapes, types, offsets = {}, {}, {}
        for _ in range(self.count(tensors, _TENSOR_BYTES, "tensors")):
            name = self.string()
            if name in shapes:
                raise _Malformed(f"tensor {name!r} appears twice")
            (dims,) = self.unpack("<I")
            if not 1 <= dims <= MAX_DIMS:
                raise _Malformed(f"tensor {name!r} has {dims} dimensions (1 to {MAX_DIMS})")
            shapes[name] = self.unpack(f"<{dims}Q")[::-1]
            code, offsets[name] = self.unpack("<IQ")
            types[name] = _tensor_type(name, code, shapes[name])
            if offsets[name] % alignment:
                raise _Malformed(f"tensor {name!r} starts at {offsets[name]}, not a multiple of {alignment}")
        start = -(-self.offset // alignment) * alignment
        spans = sorted(
            (offsets[name], offsets[name] + _nbytes(shapes[name], types[name]), name) for name in shapes
        )
        for (_, end, before), (begin, _, name) in itertools.pairwise(spans):
            if begin < end:
                raise _Malformed(f"tensors {before!r} and {name!r} overlap")
        # A vocabulary-only file (llama.cpp's --vocab-only) ends with its metadata, unpadded.
        needed = start + spans[-1][1] if spans else self.offset
        if len(self.data) < needed:
            raise _CutShort(f"{len(self.data)} bytes; its tensors end at byte {needed}")
        return Header(path, metadata, shapes, types, {name: start + at for name, at in offsets.items()})

    def unpack(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        if self.offset + size > len(self.data):
            raise _Malformed(
                f"its header runs past the end of its {len(self.data)} bytes; the download may be incomplete"
            )
        values = struct.unpack_from(fmt, self.data, self.offset)
        self.offset += size
        return values

    def count(self, count: int, smallest: int, what: str) -> int:
        """`count`, if that many items of at least `smallest` bytes each fit in the bytes left."""
        left = len(self.data) - self.offset
        if count * smallest > left:
            raise _Malformed(
                f"{count} {what} at byte {self.offset}, more than the {left} bytes left can hold"
            )
        return count

    def kind(self, what: str) -> _V:
        (code,) = self.unpack("<I")
        if code not in _V._value2member_map_:
            raise _Malformed(f"{what} has value type {code}, which GGUF does not define")
        return _V(code)

    def string(self) -> str:
        (length,) = self.unpack("<Q")
        raw = self.data[self.offset : self.offset + self.count(length, 1, "string bytes")]
        self.offset += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _Malformed(f"a string at byte {self.offset - length} is not UTF-8 ({exc.reason})") from None

    def value(self, kind: _V, what: str, depth: int = 0):
        if kind == _V.STRING:
            return self.string()
        if kind != _V.ARRAY:
            return self.unpack(_SCALARS[kind])[0]
        if depth == MAX_DEPTH:
            raise _Malformed(f"{what} nests arrays more than {MAX_DEPTH} deep")
        item = self.kind(what)
        (count,) = self.unpack("<Q")
        self.count(count, _SMALLEST[item], f"items of {what}")
        if item in _SCALARS:  # numbers in one read (a vocabulary's token types)
            dtype = np.dtype(_SCALARS[item])
            values = np.frombuffer(self.data, dtype, count, self.offset)
            self.offset += count * dtype.itemsize
            return values.tolist()
        return [self.value(item, what, depth + 1) for _ in range(count)]


def _tensor_type(name: str, code: int, shape: tuple[int, ...]) -> gguf.GGMLQuantizationType:
    """Tensor `name`'s ggml type, if the installed gguf package knows its size and `shape` is whole blocks."""
    if code not in gguf.GGMLQuantizationType._value2member_map_:
        raise _Malformed(
            f"tensor {name!r} has ggml type {code}, which the installed gguf package does not know "
            f"(a newer type?)"
        )
    kind = gguf.GGMLQuantizationType(code)
    if kind not in gguf.GGML_QUANT_SIZES:
        raise _Malformed(f"tensor {name!r} has ggml type {kind.name}, whose size gguf does not give")
    values = gguf.GGML_QUANT_SIZES[kind][0]
    if shape[-1] % values:
        raise _Malformed(f"tensor {name!r} of type {kind.name} is {shape[-1]} wide, not blocks of {values}")
    return kind


def _nbytes(shape: tuple[int, ...], kind: gguf.GGMLQuantizationType) -> int:
    values, size = gguf.GGML_QUANT_SIZES[kind]
    return math.prod(shape) // values * size


def _is_integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _all(check: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda value: isinstance(value, list) and all(map(check, value))


def _kind(value) -> str:
    """What a metadata value is, for messages."""
    if isinstance(value, list):
        return f"an array of {len(value)}"
    return {bool: "a bool", str: "a string", float: "a float"}.get(type(value), "an integer")
