"""A least-recently-used cache with a byte budget, for device arrays computed from the weights: `klein
serve`'s reference and prompt caches and the pipeline's RoPE tables (keys: `klein.pipeline.cache_keys`).
An entry larger than the whole budget is computed, used and not kept. The event loop may look up or remove
while the worker computes and stores, so the bookkeeping holds a lock; computing happens outside it. With
`shares` owners (API keys) each is sure of its share (`victim`; docs/design/serving.md).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

import jax


def arrays(value: Any) -> list:
    """The leaves of a pytree, looking into dataclasses (`References`) too."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [leaf for field in dataclasses.fields(value) for leaf in arrays(getattr(value, field.name))]
    return jax.tree.leaves(value)


def device_bytes(value: Any) -> int:
    """Bytes that the arrays of a value occupy on devices, summed over every shard this process holds."""
    total = 0
    for leaf in arrays(value):
        if isinstance(leaf, jax.Array):
            total += sum(shard.data.nbytes for shard in leaf.addressable_shards)
    return total


def key_bytes(key: Hashable) -> int:
    """Bytes of the text and byte strings in a key (a tuple's, counted through)."""
    if isinstance(key, str):
        return len(key.encode())
    if isinstance(key, bytes):
        return len(key)
    if isinstance(key, tuple):
        return sum(key_bytes(part) for part in key)
    return 0


@dataclasses.dataclass
class Entry:
    value: Any
    size: int
    """Device bytes, and the key's (`key_bytes`)."""
    seconds: float
    """What computing the value took (compilation aside, where the caller books it apart): what a hit saves."""
    owner: Hashable = None
    """Whose share it counts against."""


@dataclasses.dataclass
class Stats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    too_large: int = 0
    """Entries computed and used but not kept: each alone was over the budget."""


class ByteBudgetCache:
    """Keys -> device values, never holding more than `budget` bytes; least recently used leave first,
    within each owner's share (`shares` owners)."""

    def __init__(self, budget: int, shares: int = 1):
        self.budget, self.share = budget, budget // shares
        self.bytes = 0
        self.stats = Stats()
        self._entries: collections.OrderedDict[Hashable, Entry] = collections.OrderedDict()
        self._held: collections.Counter[Hashable] = collections.Counter()
        """Bytes held by each owner."""
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def keys(self) -> list[Hashable]:
        """The keys held now (a copy: the cache may change while a caller looks through them)."""
        with self._lock:
            return list(self._entries)

    def peek(self, key: Hashable) -> Entry | None:
        """The entry under `key`, if held, without counting a hit or refreshing its age."""
        return self._entries.get(key)

    def lookup(self, key: Hashable) -> Entry | None:
        """The entry under `key` (now the most recently used), counting a hit or a miss."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.stats.misses += 1
                return None
            self.stats.hits += 1
            self._entries.move_to_end(key)
            return entry

    def held(self) -> dict[Hashable, int]:
        """Bytes held by each owner that holds any."""
        with self._lock:
            return {owner: size for owner, size in self._held.items() if size}

    def put(self, key: Hashable, value: Any, seconds: float, owner: Hashable = None) -> Entry:
        """Keep `value` as `owner`'s (unless it alone exceeds a share), evicting the least recently used
        first, as `victim` chooses."""
        entry = Entry(value, device_bytes(value) + key_bytes(key), seconds, owner)
        with self._lock:
            self.remove(key)
            if entry.size > self.share:
                self.stats.too_large += 1
                return entry
            while self.bytes + entry.size > self.budget:
                chosen = victim(self._entries.items(), self._held, owner, entry.size, self.share)
                self.remove(next(iter(self._entries)) if chosen is None else chosen)
                self.stats.evictions += 1
            self._entries[key] = entry
            self.bytes += entry.size
            self._held[owner] += entry.size
            return entry

    def remove(self, key: Hashable) -> bool:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self.bytes -= entry.size
                self._held[entry.owner] -= entry.size
            return entry is not None

    def get(self, key: Hashable, compute: Callable[[], Any], owner: Hashable = None) -> Any:
        """The value under `key`, or `compute()`'s, kept for next time as `owner`'s if it fits."""
        entry = self.lookup(key)
        if entry is None:
            started = time.perf_counter()
            value = compute()
            jax.block_until_ready(arrays(value))
            entry = self.put(key, value, time.perf_counter() - started, owner)
        return entry.value


def victim(entries, held: dict, owner: Hashable, size: int, share: int) -> Hashable:
    """The key to evict for `owner` to add `size` bytes: its own least recently used entry if it would
    then hold more than its `share`, else the least recently used of an owner holding more than its share
    (there is one when the budget is `share` times the owners), else None. `entries`: (key, entry) with
    `.owner` and `.size`, least recently used first; `held`: bytes by owner."""
    over = {owner} if held.get(owner, 0) + size > share else {o for o, b in held.items() if b > share}
    return next((key for key, entry in entries if entry.owner in over), None)
