"""Which Linears of a checkpoint keep their file's quantisation blocks in memory (GGUF, NVFP4), how many
bytes they take there, and how a layer of a stack of mixed GGUF types is laid out: one description for the
readers and the planner (`klein.memory.stored`). See docs/design/checkpoints.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from klein.io.gguf_header import Header
from klein.io.mapped import Through
from klein.models import gguf_blocks, products


def gguf_formats(header: Header) -> dict[str, str]:
    """Stored layer (tensor name without `.weight`) -> ggml type, for a GGUF file's quantised tensors."""
    types = {name.removesuffix(".weight"): kind.name for name, kind in header.types.items()}
    return {layer: kind for layer, kind in types.items() if kind in gguf_blocks.TYPES}


def layer_bytes(blocks: str | tuple[str, ...], rows: int, columns: int) -> int:
    """Bytes a layer of `rows` rows of `columns` values kept as `blocks` holds in memory: its rows of blocks
    (a mixed stack's padded and tagged) and an NVFP4 layer's float32 per-tensor scale."""
    return products.packed_width(blocks, columns) * rows + 4 * (blocks == products.NVFP4)


def stack_blocks(kinds: Sequence[str | None]) -> str | tuple[str, ...] | None:
    """The `blocks` of a stack whose layers have block formats `kinds` (None: stored otherwise): the one
    format, the tuple of its ggml types (in `products.BLOCKS` order) if several, else None (widened)."""
    found = set(kinds)
    if len(found) == 1 and found <= set(products.BLOCKS):
        return found.pop()
    if found <= set(gguf_blocks.TYPES):
        return tuple(kind for kind in products.BLOCKS if kind in found)
    return None


def kept_blocks(
    stored_layers: dict[tuple, Sequence[str]], formats: dict[str, str]
) -> dict[tuple, str | tuple]:
    """Module paths of the Linears kept as blocks, with their `blocks`; `stored_layers`: parameter path ->
    the stored layer of each of its checkpoint keys, `formats`: stored layer -> format."""
    found = {}
    for path, layers in stored_layers.items():
        blocks = stack_blocks([formats.get(layer) for layer in layers])
        if path[-1] == "kernel" and blocks is not None:
            found[path[:-1]] = blocks
    return found


@dataclasses.dataclass(frozen=True)
class Tagged(Through):
    """A layer of a mixed stack (`blocks`, a tuple of ggml types): `piece`'s rows of blocks of type `kind`
    uint8[rows, bytes], zero-padded to the stack's row width and ending in the index of `kind`."""

    blocks: tuple[str, ...]
    kind: str

    def shape(self, source) -> tuple[int, ...]:
        *rows, width = self.piece.shape(source)
        return (*rows, products.packed_width(self.blocks, products.unpacked_width(self.kind, width)))

    def read(self, source) -> np.ndarray:
        raw = self.piece.read(source)
        out = np.zeros(self.shape(source), np.uint8)
        out[..., : raw.shape[-1]] = raw
        out[..., -1] = self.blocks.index(self.kind)
        return out


def layer_piece(piece, blocks: str | tuple[str, ...], kind: str):
    """`piece` (reading a layer's blocks as stored) as a stack of format `blocks` holds it."""
    return Tagged(piece, blocks, kind) if isinstance(blocks, products.MIXED) else piece
