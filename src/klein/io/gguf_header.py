"""A GGUF file's header: its metadata and the names, shapes, types and data offsets of its tensors, no
tensor read.

`gguf.GGUFReader` makes a NumPy view of every part of every metadata value as it opens a file: a Qwen3
GGUF's 151936 tokens and 151387 merges take it over a million views (16.9 s here, against 0.7 s with `struct`:
`benchmarks/gguf_header.py`, AMD EPYC, 2 cores shared), and it maps every tensor as well. So every GGUF
klein opens is read with this header alone: a text encoder is located, its configuration read and its
tokenizer rebuilt from it, the planner sizes a file's tensors from it, and `klein.io.gguf_file` reads each
tensor's bytes at the offset it gives. The layout is GGUF's (version 2 and 3, little-endian): magic, version,
tensor count, metadata count, the metadata (key, type, value), the tensor infos (name, dimensions innermost
first, type, offset), then the aligned tensor data.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import struct
from pathlib import Path

import gguf
import numpy as np

from klein.errors import CheckpointError

_V = gguf.GGUFValueType
_SCALARS = {
    _V.UINT8: "<B", _V.INT8: "<b", _V.UINT16: "<H", _V.INT16: "<h", _V.UINT32: "<I", _V.INT32: "<i",
    _V.FLOAT32: "<f", _V.BOOL: "<?", _V.UINT64: "<Q", _V.INT64: "<q", _V.FLOAT64: "<d",
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Header:
    """What a GGUF says about itself before its tensor data."""

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
        values, size = gguf.GGML_QUANT_SIZES[self.types[name]]
        return math.prod(self.shapes[name]) // values * size


def read_header(path: str | Path) -> Header:
    """The header of the GGUF at `path`; a CheckpointError for a file that is not one, or is cut short."""
    path = Path(path)
    size = path.stat().st_size
    try:
        with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            header, infos_end, data_bytes = _parse(data)
    except (struct.error, ValueError, KeyError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"{path}: not a readable GGUF file ({exc or type(exc).__name__}); the download may be incomplete, "
            f"or a tensor type is newer than the installed gguf package"
        ) from None
    alignment = int(header.metadata.get(gguf.Keys.General.ALIGNMENT, gguf.GGUF_DEFAULT_ALIGNMENT))
    start = -(-infos_end // alignment) * alignment
    # A vocabulary-only file (llama.cpp's --vocab-only) ends with its metadata, unpadded.
    needed = start + data_bytes if header.shapes else infos_end
    if size < needed:
        raise CheckpointError(
            f"{path}: cut short ({size} bytes; its tensors end at byte {needed}): the download is incomplete"
        )
    return dataclasses.replace(header, offsets={name: start + at for name, at in header.offsets.items()})


def _parse(data) -> tuple[Header, int, int]:
    """(header with offsets from the tensor data's start, where the tensor infos end, bytes from the tensor
    data's start to its last tensor's end)."""
    magic, version = struct.unpack_from("<II", data, 0)
    if magic != gguf.GGUF_MAGIC or version not in (2, 3):
        raise ValueError(f"magic {magic:#x}, version {version}: not a little-endian GGUF of version 2 or 3")
    tensors, count = struct.unpack_from("<QQ", data, 8)
    offset, metadata = 24, {}
    for _ in range(count):
        key, offset = _string(data, offset)
        (kind,), offset = struct.unpack_from("<I", data, offset), offset + 4
        metadata[key], offset = _value(data, offset, _V(kind))
    shapes, types, offsets, end = {}, {}, {}, 0
    for _ in range(tensors):
        name, offset = _string(data, offset)
        (dims,), offset = struct.unpack_from("<I", data, offset), offset + 4
        shape = struct.unpack_from(f"<{dims}Q", data, offset)[::-1]
        kind, start = struct.unpack_from("<IQ", data, offset + 8 * dims)
        offset += 8 * dims + 12
        shapes[name], types[name] = tuple(int(n) for n in shape), gguf.GGMLQuantizationType(kind)
        offsets[name] = start
        block, size = gguf.GGML_QUANT_SIZES[types[name]]
        end = max(end, start + math.prod(shape) // block * size)
    return Header(metadata, shapes, types, offsets), offset, end


def _string(data: bytes, offset: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", data, offset)
    end = offset + 8 + length
    if end > len(data):
        raise ValueError("the header runs past the end of the file")
    return data[offset + 8 : end].decode("utf-8"), end


def _value(data: bytes, offset: int, kind: _V):
    if kind == _V.STRING:
        return _string(data, offset)
    if kind != _V.ARRAY:
        fmt = _SCALARS[kind]
        return struct.unpack_from(fmt, data, offset)[0], offset + struct.calcsize(fmt)
    item, count = struct.unpack_from("<IQ", data, offset)
    offset += 12
    if _V(item) in _SCALARS:  # numbers in one read (a vocabulary's token types)
        dtype = np.dtype(_SCALARS[_V(item)])
        values = np.frombuffer(data, dtype, count, offset)
        return values.tolist(), offset + count * dtype.itemsize
    values = []
    for _ in range(count):
        value, offset = _value(data, offset, _V(item))
        values.append(value)
    return values, offset
