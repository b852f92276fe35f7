"""A checkpoint seen under the key names a model expects: renamed, split, reordered or dequantised tensors.

A `MappedSource` presents a single file (fused qkv, 1x1 convolutions, FP8 with scales) to the strict loader
as if it had the model's own keys, each a small piece that reads one tensor, or rows of one, at a time;
stored keys that no piece reads keep their names, so that the loader reports them as unexpected.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np


@dataclasses.dataclass(frozen=True)
class Whole:
    """A stored tensor as it is."""

    key: str

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.key,)

    def shape(self, source) -> tuple[int, ...]:
        return source.shape(self.key)

    def read(self, source) -> np.ndarray:
        return source.get(self.key)


@dataclasses.dataclass(frozen=True)
class Rows(Whole):
    """Block `index` of `count` equal blocks of rows (output features) of a fused tensor."""

    index: int = 0
    count: int = 1

    def shape(self, source) -> tuple[int, ...]:
        stored = source.shape(self.key)
        # An indivisible (or scalar) tensor keeps its own shape, which the loader then reports as wrong.
        if not stored or stored[0] % self.count:
            return stored
        return (stored[0] // self.count, *stored[1:])

    def read(self, source) -> np.ndarray:
        block = source.shape(self.key)[0] // self.count
        return source.get(self.key, rows=slice(self.index * block, (self.index + 1) * block))


@dataclasses.dataclass(frozen=True)
class SwappedHalves(Whole):
    """The two halves of the rows in the other order (BFL's final (shift, scale) is diffusers' (scale, shift))."""

    def read(self, source) -> np.ndarray:
        array = source.get(self.key)
        half = array.shape[0] // 2
        return np.concatenate([array[half:], array[:half]])


@dataclasses.dataclass(frozen=True)
class Squeezed(Whole):
    """A 1x1 convolution weight [out, in, 1, 1] read as the equivalent Linear weight [out, in]."""

    def shape(self, source) -> tuple[int, ...]:
        stored = source.shape(self.key)
        return stored[:2] if stored[2:] == (1, 1) else stored

    def read(self, source) -> np.ndarray:
        array = source.get(self.key)
        return array.reshape(array.shape[:2])


@dataclasses.dataclass(frozen=True)
class Scalar(Whole):
    """A per-tensor scale, stored as shape () or (1,)."""

    def shape(self, source) -> tuple[int, ...]:
        stored = source.shape(self.key)
        return () if stored in ((), (1,)) else stored

    def read(self, source) -> np.ndarray:
        return source.get(self.key).astype(np.float32).reshape(())


@dataclasses.dataclass(frozen=True)
class Through:
    """A piece that reads another, `piece`: its stored keys and, unless it says otherwise, its shape."""

    piece: Whole

    @property
    def keys(self) -> tuple[str, ...]:
        return self.piece.keys

    def shape(self, source) -> tuple[int, ...]:
        return self.piece.shape(source)


@dataclasses.dataclass(frozen=True)
class Dequantized(Through):
    """`piece` (an FP8 weight, or rows of one) times its float32 per-tensor scale, widened to float32."""

    scale_key: str

    @property
    def keys(self) -> tuple[str, ...]:
        return (*self.piece.keys, self.scale_key)

    def read(self, source) -> np.ndarray:
        return self.piece.read(source).astype(np.float32) * Scalar(self.scale_key).read(source)


@dataclasses.dataclass(frozen=True)
class Viewed(Through):
    """`piece` read from `view(source)`: the source's tensors in another form (a GGUF file's blocks as
    stored, `klein.io.gguf_file.GGUFSource.blocks`; an NVFP4 file's, `klein.io.nvfp4_file`)."""

    view: Callable

    def shape(self, source) -> tuple[int, ...]:
        return self.piece.shape(self.view(source))

    def read(self, source) -> np.ndarray:
        return self.piece.read(self.view(source))


class MappedSource:
    """`source` under new keys: `table` maps each new key to the piece that reads it; `dropped` names stored
    keys read by nothing on purpose. Pieces whose stored tensors are absent are left out (keys missing)."""

    def __init__(self, source, table: dict, dropped: Iterable[str] = ()):
        have = source.keys()
        self._source = source
        self._table = {key: piece for key, piece in table.items() if set(piece.keys) <= have}
        read = {stored for piece in table.values() for stored in piece.keys}
        self._rest = have - read - set(dropped)

    def keys(self) -> set[str]:
        return set(self._table) | self._rest

    @property
    def inner(self):
        """The source the pieces read."""
        return self._source

    def piece(self, key: str):
        """The piece that reads `key`, or None where `key` is a stored tensor read as it is."""
        return self._table.get(key)

    def file_of(self, key: str) -> Path:
        return self._source.file_of(self._table[key].keys[0] if key in self._table else key)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._table[key].shape(self._source) if key in self._table else self._source.shape(key)

    def get(self, key: str) -> np.ndarray:
        return self._table[key].read(self._source) if key in self._table else self._source.get(key)


class Joined:
    """Several sources seen as one: `parts` pairs each source with the predicate saying which of its keys it
    gives (a decoder-only VAE file, and the encoder and latent statistics of another VAE); a key two parts
    give comes from the first."""

    def __init__(self, parts: Iterable[tuple]):
        self._owner = {}
        for source, gives in parts:
            for key in source.keys():
                if gives(key):
                    self._owner.setdefault(key, source)

    def keys(self) -> set[str]:
        return set(self._owner)

    def file_of(self, key: str) -> Path:
        return self._owner[key].file_of(key)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._owner[key].shape(key)

    def get(self, key: str) -> np.ndarray:
        return self._owner[key].get(key)
