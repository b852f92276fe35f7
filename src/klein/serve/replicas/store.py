"""The front's reference sets: each set's prepared images in Ray's object store, so that any replica can
encode a set it has not seen; least recently used out within --cache-bytes (each key its share)."""

from __future__ import annotations

import collections
import dataclasses

import ray

from klein.pipeline.cache import victim
from klein.pipeline.cache_keys import set_id
from klein.serve.errors import ApiError
from klein.serve.reference_sets import MAX_IDS, PreparedImage, describe


@dataclasses.dataclass
class _Set:
    images: ray.ObjectRef
    sizes: tuple[tuple[int, int], ...]
    size: int
    owner: str | None
    described: dict | None = None
    """The reference object the replica that encoded it answered (`POST /v1/references`)."""


class ReferenceStore:
    def __init__(self, budget: int, shares: int = 1):
        self.budget, self.share, self.bytes = budget, budget // shares, 0
        self._sets: collections.OrderedDict[tuple[str | None, str], _Set] = collections.OrderedDict()
        """(owner, id) -> set, least recently used first."""
        self._held: collections.Counter[str | None] = collections.Counter()

    def held(self) -> dict:
        """Bytes of pixels kept by each owner that keeps any."""
        return {owner: size for owner, size in self._held.items() if size}

    def put(self, images: tuple[PreparedImage, ...], owner: str | None = None) -> str:
        """Keep a set's images as `owner`'s (again: most recently used); its id."""
        reference_id = set_id(tuple(image.digest for image in images))
        if (owner, reference_id) in self._sets:
            self._sets.move_to_end((owner, reference_id))
            return reference_id
        size = sum(image.pixels.nbytes for image in images)
        sizes = tuple(image.pixels.shape[:2] for image in images)
        while self.bytes + size > self.budget:  # a set alone over its share is kept, past the budget
            chosen = victim(self._sets.items(), self._held, owner, size, self.share)
            if chosen is None:
                break
            self._drop(chosen)
        self._sets[owner, reference_id] = _Set(ray.put(images), sizes, size, owner)
        self.bytes += size
        self._held[owner] += size
        own = [key for key in self._sets if key[0] == owner]
        for key in own[: max(0, len(own) - MAX_IDS)]:
            self._drop(key)
        return reference_id

    def _drop(self, key) -> _Set | None:
        found = self._sets.pop(key, None)
        if found is not None:
            self.bytes -= found.size
            self._held[found.owner] -= found.size
        return found

    def images(self, key: str, owner: str | None = None) -> ray.ObjectRef:
        """The images of `owner`'s set by id; a 404 `ApiError` for an id the front does not hold."""
        found = self._sets.get((owner, key))
        if found is None:
            raise ApiError(
                404,
                f"unknown reference id {key!r:.80}, or its images were dropped (--cache-bytes, or a restart "
                "of the front, which keeps them in its memory); upload the images again (POST "
                "/v1/references, or send them with the edit)",
                "unknown_reference",
                "references",
            )
        self._sets.move_to_end((owner, key))
        return found.images

    def described(self, key: str, answer: dict, owner: str | None = None) -> None:
        if (owner, key) in self._sets:
            self._sets[owner, key].described = answer

    def describe(self, key: str, owner: str | None = None) -> dict | None:
        found = self._sets.get((owner, key))
        if found is None:
            return None
        return found.described or describe(key, found.sizes, 0, False)

    def delete(self, key: str, owner: str | None = None) -> bool:
        """Forget `owner`'s set (the replicas' caches drop its encodings as they need room)."""
        return self._drop((owner, key)) is not None
