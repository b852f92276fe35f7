"""Reference sets uploaded once (POST /v1/references) and named by id while the same images flow: the
client keeps set key (the images' hash, `convert.set_key`) -> id per server, and uploads again when the
server no longer knows the id (evicted from its cache, or the server restarted)."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

from .client import Client, KleinError

KEPT = 64
"""Sets remembered per process, most recent first out of mind last."""


class ReferenceSets:
    def __init__(self, kept: int = KEPT):
        self.kept = kept
        self._ids: collections.OrderedDict[tuple[str, str, str], str] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.uploads = 0
        """Sets uploaded by this process (for tests and logs)."""

    def run(self, client: Client, pngs: list[bytes], key: str, use: Callable[[str], dict]) -> dict:
        """`use(id)` with the id of the set of `pngs` on `client`'s server: a known id first; uploaded when
        none is known, or again once when the server answers that the id is unknown."""
        slot = (client.url, client.api_key, key)
        with self._lock:
            known = self._ids.get(slot)
        if known is not None:
            try:
                return use(known)
            except KleinError as error:
                if error.code != "unknown_reference":
                    raise
        return use(self._upload(client, pngs, slot))

    def _upload(self, client: Client, pngs: list[bytes], slot) -> str:
        reference_id = client.post_files("/v1/references", {}, [("image", data) for data in pngs])["id"]
        with self._lock:
            self.uploads += 1
            self._ids[slot] = reference_id
            self._ids.move_to_end(slot)
            while len(self._ids) > self.kept:
                self._ids.popitem(last=False)
        return reference_id
