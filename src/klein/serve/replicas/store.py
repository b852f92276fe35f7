"""The front's reference sets: each uploaded set's prepared images, kept in Ray's object store, so that
any replica can encode a set it has not seen (a set's first request there, a restarted replica, a set
its cache dropped) and an id from `POST /v1/references` works on every replica.

Ids are those of a single `klein serve` (`klein.pipeline.cache_keys.set_id`, from the images' content
hashes). Sets are kept least recently used first out, within a byte budget of prepared pixels
(--cache-bytes) and `MAX_IDS` ids.
"""

from __future__ import annotations

import collections
import dataclasses

import ray

from klein.pipeline.cache_keys import set_id
from klein.serve.errors import ApiError
from klein.serve.reference_sets import MAX_IDS, PreparedImage, describe


@dataclasses.dataclass
class _Set:
    images: ray.ObjectRef
    sizes: tuple[tuple[int, int], ...]
    bytes: int
    described: dict | None = None
    """The reference object the replica that encoded it answered (`POST /v1/references`)."""


class ReferenceStore:
    def __init__(self, budget: int):
        self.budget, self.bytes = budget, 0
        self._sets: collections.OrderedDict[str, _Set] = collections.OrderedDict()

    def put(self, images: tuple[PreparedImage, ...]) -> str:
        """Keep a set's images (again: most recently used); its id."""
        key = set_id(tuple(image.digest for image in images))
        if key in self._sets:
            self._sets.move_to_end(key)
            return key
        size = sum(image.pixels.nbytes for image in images)
        sizes = tuple(image.pixels.shape[:2] for image in images)
        self._sets[key] = _Set(ray.put(images), sizes, size)
        self.bytes += size
        while len(self._sets) > 1 and (self.bytes > self.budget or len(self._sets) > MAX_IDS):
            _, old = self._sets.popitem(last=False)
            self.bytes -= old.bytes
        return key

    def images(self, key: str) -> ray.ObjectRef:
        """The images of a set by id; a 404 `ApiError` for an id the front does not hold."""
        found = self._sets.get(key)
        if found is None:
            raise ApiError(
                404,
                f"unknown reference id {key!r:.80}, or its images were dropped (--cache-bytes, or a restart "
                "of the front, which keeps them in its memory); upload the images again (POST "
                "/v1/references, or send them with the edit)",
                "unknown_reference",
                "references",
            )
        self._sets.move_to_end(key)
        return found.images

    def described(self, key: str, answer: dict) -> None:
        if key in self._sets:
            self._sets[key].described = answer

    def describe(self, key: str) -> dict | None:
        found = self._sets.get(key)
        if found is None:
            return None
        return found.described or describe(key, found.sizes, 0, False)

    def delete(self, key: str) -> bool:
        """Forget a set (the replicas' caches drop its encodings as they need room)."""
        found = self._sets.pop(key, None)
        if found is not None:
            self.bytes -= found.bytes
        return found is not None
