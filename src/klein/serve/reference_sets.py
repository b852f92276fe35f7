"""Reference sets, content-addressed (docs/design/serving.md, "Serving"): uploaded images -> `References`
through the cache. `describe` and `delete` run on the event loop, encoding on the worker: hence the lock."""

from __future__ import annotations

import collections
import dataclasses
import threading

import jax
import numpy as np

from klein.errors import InputError
from klein.pipeline import cache_keys
from klein.pipeline.cache import ByteBudgetCache, arrays
from klein.pipeline.cache_keys import set_id
from klein.pipeline.timing import Timed
from klein.request.references import References

MAX_IDS = 4096  # ids remembered; each is a few digests, the arrays live (or not) in the cache


@dataclasses.dataclass(frozen=True)
class PreparedImage:
    digest: str
    pixels: np.ndarray
    """float32[H, W, 3] in [-1, 1]."""

    @classmethod
    def of(cls, pixels: np.ndarray, preparation: str = cache_keys.REFERENCE) -> PreparedImage:
        """`preparation`: `cache_keys.REFERENCE` or `cache_keys.SOURCE`, how `pixels` were prepared."""
        return cls(cache_keys.image_digest(pixels, preparation), pixels)


class UnknownReferences(InputError):
    """A reference id the server does not know, or whose encodings the cache no longer holds."""


@dataclasses.dataclass(frozen=True)
class Encoded:
    id: str
    references: References
    hit: bool
    """The whole set came from the cache."""
    saved_seconds: float
    """Compute time the cache saved (whole set, or the latents of some images)."""
    bytes: int
    timings: dict[str, float]
    digests: tuple[str, ...] = ()
    """Each image's content hash, in order (what a served PNG records as its references)."""


class ReferenceSets:
    """Encodes reference sets through a `ByteBudgetCache` and remembers which digests each owner's id
    names. `owner`: the label of the API key a request came with (None without keys)."""

    def __init__(self, pipe, cache: ByteBudgetCache, cached: bool):
        self.pipe, self.cache, self.cached = pipe, cache, cached
        """`cached`: encode with the prefill's keys/values (KV checkpoints)."""
        self._ids: dict[str | None, collections.OrderedDict[str, tuple]] = {}
        """Owner -> id -> (digests, sizes), least recently used first."""
        self._lock = threading.Lock()

    def _set_key(self, owner, digests: tuple[str, ...], loras=()):
        """A set's key: its keys/values (`cached`) are those of the weights with the request's unmerged
        LoRAs applied, so each LoRA set has its own entry and none is served another's."""
        weights = self.pipe.adapted_weights_id(loras) if self.cached else self.pipe.weights_id
        return cache_keys.set_key(digests, weights, self.cached, owner)

    def _latents_key(self, owner, digest: str):
        return cache_keys.latents_key(digest, self.pipe.model_id, owner)

    def encode(self, images: list[PreparedImage], loras=(), owner=None) -> Encoded:
        """The set of these images, from the cache or computed (and then kept if it fits), prefilled under
        the unmerged LoRAs `loras` (`klein.request.loras.LoraUse`s) on a KV checkpoint."""
        digests = tuple(image.digest for image in images)
        sizes = tuple(image.pixels.shape[:2] for image in images)
        self._remember(owner, set_id(digests), digests, sizes)
        pixels = {i.digest: i.pixels for i in images}
        return self._cached_set(owner, digests, loras) or self._compute(owner, digests, pixels, loras)

    def resolve(self, reference_id: str, loras=(), owner=None) -> Encoded:
        """The set an id names; `UnknownReferences` if the id is unknown or its encodings were evicted."""
        digests, _, _ = self._usable(owner, reference_id)
        return self._cached_set(owner, digests, loras) or self._compute(owner, digests, {}, loras)

    def sizes(self, reference_id: str, owner=None) -> tuple[tuple[int, int], ...]:
        """(height, width) px of each image of the set an id names; `UnknownReferences` as `resolve`."""
        return self._usable(owner, reference_id)[1]

    def _usable(self, owner, reference_id: str) -> tuple:
        """(digests, sizes, the set's encoding or None) of an id of `owner`'s (now its most recently used)
        whose set, or else every image's latents, the cache still holds. Another owner's ids are not looked
        at, so a key that computes another's id from the images' bytes finds nothing."""
        with self._lock:
            own = self._ids.get(owner, {})
            known = own.get(reference_id)
            if known is not None:
                own.move_to_end(reference_id)
        if known is None:
            raise UnknownReferences(
                f"unknown reference id {reference_id!r:.80}; upload the images with POST /v1/references first"
            )
        entry = self._encoding(owner, known[0])
        if entry is None and not all(self._latents_key(owner, d) in self.cache for d in known[0]):
            raise UnknownReferences(_evicted(reference_id))
        return (*known, entry)

    def describe(self, reference_id: str, owner=None) -> dict | None:
        """The contract's reference object, or None when the id cannot be used (unknown or evicted):
        a set that is described can be used, under any LoRAs."""
        try:
            _, sizes, entry = self._usable(owner, reference_id)
        except UnknownReferences:
            return None
        return describe(reference_id, sizes, entry.size if entry else 0, entry is not None)

    def _encoding(self, owner, digests):
        """An encoding of the set held under any weights (any LoRAs), or None: its tokens are every image's
        latents, from which the set is prefilled again under other LoRAs (`_compute`)."""
        return next(
            (self.cache.peek(k) for k in self.cache.keys() if cache_keys.of_set(k, digests, owner)), None
        )

    def _kept_latents(self, owner, digests) -> list:
        """Each image's latents, from an encoding of the set still held; `UnknownReferences` if none is
        (evicted since the request was checked)."""
        entry = self._encoding(owner, digests)
        if entry is None:
            raise UnknownReferences(_evicted(set_id(digests)))
        return split_latents(entry.value, self.pipe.vae_config.pixels_per_token)

    def delete(self, reference_id: str, owner=None) -> bool:
        """Forget an id and drop its set's encodings under every LoRA set (per-image latents may serve other
        sets and stay)."""
        with self._lock:
            known = self._ids.get(owner, {}).pop(reference_id, None)
        if known is None:
            return False
        digests, _ = known
        for key in self.cache.keys():
            if cache_keys.of_set(key, digests, owner):
                self.cache.remove(key)
        return True

    def _remember(self, owner, reference_id, digests, sizes) -> None:
        """Remember an id among the owner's last `MAX_IDS` (one key's uploads do not push out another's)."""
        with self._lock:
            own = self._ids.setdefault(owner, collections.OrderedDict())
            own[reference_id] = (digests, sizes)
            own.move_to_end(reference_id)
            while len(own) > MAX_IDS:
                own.popitem(last=False)

    def _cached_set(self, owner, digests, loras=()) -> Encoded | None:
        entry = self.cache.lookup(self._set_key(owner, digests, loras))
        if entry is None:
            return None
        return Encoded(set_id(digests), entry.value, True, entry.seconds, entry.size, {}, digests)

    def _compute(self, owner, digests, pixels: dict[str, np.ndarray], loras=()) -> Encoded:
        """Encode the set: each image's latents from the cache, else from its pixels, else (the pixels not
        sent, the latents evicted) from an encoding of the set still held; then the set from them."""
        # Compilation is booked apart (klein.pipeline.timing): an entry's cost is what a hit saves next time.
        timings = {"references": 0.0, "prefill": 0.0}
        latents, saved, kept = [], 0.0, None
        for index, digest in enumerate(digests):
            entry = self.cache.lookup(self._latents_key(owner, digest))
            if entry is not None:
                saved += entry.seconds
                latents.append(entry.value)
            elif digest in pixels:
                before = timings["references"]
                with Timed(timings, "references"):
                    z = jax.block_until_ready(self.pipe.encode_reference_latents(pixels[digest]))
                self.cache.put(self._latents_key(owner, digest), z, timings["references"] - before, owner)
                latents.append(z)
            else:
                kept = kept or self._kept_latents(owner, digests)
                latents.append(kept[index])
        with Timed(timings, "prefill"):
            references = self.pipe.references_from_latents(latents, self.cached, loras)
            jax.block_until_ready(arrays(references))
        cost = saved + timings["references"] + timings["prefill"]
        entry = self.cache.put(self._set_key(owner, digests, loras), references, cost, owner)
        return Encoded(set_id(digests), references, False, saved, entry.size, timings, digests)


def split_latents(references: References, pixels_per_token: int) -> list:
    """Each image's latents float[H/16, W/16, C] back from a set's tokens (their concatenation in order)."""
    latents, start = [], 0
    for height, width in references.pixel_sizes:
        rows, columns = height // pixels_per_token, width // pixels_per_token
        latents.append(references.tokens[start : start + rows * columns].reshape(rows, columns, -1))
        start += rows * columns
    return latents


def _evicted(reference_id: str) -> str:
    return (
        f"reference set {reference_id} was evicted from the cache (--cache-bytes); upload the images again "
        "(POST /v1/references, or send them with the edit)"
    )


def describe(reference_id: str, sizes, size_bytes: int, cached: bool) -> dict:
    images = [{"width": w, "height": h} for h, w in sizes]
    return {"id": reference_id, "images": images, "bytes": size_bytes, "cached": cached}
