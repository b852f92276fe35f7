"""Encoded reference images: what `Flux2KleinPipeline.encode_references` returns and a request can reuse."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import jax

    from klein.models.transformer import ReferenceKV


@dataclasses.dataclass(frozen=True, eq=False)
class References:
    """Encoded reference images, reusable with any prompt, seed or batch size.

    Compared by identity: two encodings of the same pictures are different objects holding equal arrays.
    """

    tokens: jax.Array
    """float[R, C]: every reference's latent tokens, concatenated in order."""
    ids: np.ndarray
    """int[R, 4]: their position ids (reference i at time 10 + 10 i)."""
    pixel_sizes: tuple[tuple[int, int], ...]
    """(height, width) px of each prepared reference."""
    kv: ReferenceKV | None
    """Per-layer keys and values from the prefill (cached-reference mode, KV checkpoints); else None."""
    weights_id: str = ""
    """The pipeline's `weights_id` when `kv` was computed; under other weights (LoRAs) it is redone."""

    @property
    def cached(self) -> bool:
        return self.kv is not None

    def __repr__(self) -> str:
        sizes = ", ".join(f"{w}x{h}" for h, w in self.pixel_sizes)
        count = len(self.pixel_sizes)
        kind = "keys and values cached" if self.cached else "tokens only"
        return f"References({count} image{'' if count == 1 else 's'}: {sizes} px; {kind})"
