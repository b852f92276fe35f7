"""Which replica a request of `klein serve --replicas N` prefers (docs/design/serving.md, "Replicas"): the
decision `router.ReferenceRouter` makes, over replica ids and without Ray, so that it can be tested alone."""

from __future__ import annotations

import collections
import random
from collections.abc import Hashable, Iterable, Sequence

MAX_HOMES = 4096
"""Sets remembered (least recently routed out): a forgotten set is homed again, like a new one."""
SLOTS = 4
"""LoRAs a replica is taken to hold: `klein.lora.slots.AdapterSlots`' slots (the default and most)."""
SEPARATOR = "|"
"""Between the set id and the LoRA names in a key: neither a set id (hex) nor a LoRA name holds it."""


def routing_key(set_id: str | None, loras: Iterable[str]) -> str:
    """The key a request is routed by: its set id and its LoRAs' names ('' with neither)."""
    names = sorted(set(loras))
    if set_id is None and not names:
        return ""
    return f"{set_id or ''}{SEPARATOR}{','.join(names)}"


def parse(key: str) -> tuple[str | None, frozenset[str]]:
    """(set id or None, LoRA names) of a `routing_key`."""
    set_id, _, names = key.partition(SEPARATOR)
    return set_id or None, frozenset(name for name in names.split(",") if name)


class Homes:
    """Each reference set's home replica, the least recently routed set forgotten first."""

    def __init__(self, most: int = MAX_HOMES):
        self.most = most
        self._homes: collections.OrderedDict[str, Hashable] = collections.OrderedDict()

    def counts(self) -> collections.Counter:
        """Sets homed on each replica."""
        return collections.Counter(self._homes.values())

    def home(self, set_id: str, ranked: Sequence[Hashable]) -> Hashable:
        """The set's home among the live replicas `ranked`; a new or homeless set gets the first."""
        home = self._homes.get(set_id)
        home = home if home in ranked else ranked[0]
        self._homes[set_id] = home
        self._homes.move_to_end(set_id)
        while len(self._homes) > self.most:
            self._homes.popitem(last=False)
        return home


class Holdings:
    """The LoRAs each replica's slots hold, as far as the router sent them: an LRU of `slots` names."""

    def __init__(self, slots: int = SLOTS):
        self.slots = slots
        self._held: dict[Hashable, collections.OrderedDict[str, None]] = {}

    def missing(self, replica: Hashable, names: Iterable[str]) -> int:
        """How many of `names` the replica's slots do not hold."""
        held = self._held.get(replica, {})
        return sum(name not in held for name in names)

    def sent(self, replica: Hashable, names: Iterable[str]) -> None:
        """A request naming `names` went to `replica`: they are its most recently used."""
        held = self._held.setdefault(replica, collections.OrderedDict())
        for name in sorted(names):
            held[name] = None
            held.move_to_end(name)
        while len(held) > self.slots:
            held.popitem(last=False)

    def keep_only(self, replicas: Iterable[Hashable]) -> None:
        """Forget replicas no longer live (a restarted one comes back under a new id, its slots empty)."""
        live = set(replicas)
        self._held = {replica: held for replica, held in self._held.items() if replica in live}


def ranks(
    replicas: Sequence[Hashable], key: str, homes: Homes, holdings: Holdings, rng: random.Random
) -> list[list[Hashable]]:
    """The replicas in ranks, most preferred first (Serve's router takes the next rank when a rank's
    replicas are full); the set's home, if the request has references, is chosen and remembered here."""
    set_id, names = parse(key)
    if set_id is None and not names:
        return [rng.sample(list(replicas), min(2, len(replicas)))]
    sets = homes.counts() if set_id is not None else collections.Counter()
    draw = {replica: rng.random() for replica in replicas}
    ranked = sorted(replicas, key=lambda r: (sets[r], holdings.missing(r, names), draw[r]))
    if set_id is not None:
        home = homes.home(set_id, ranked)
        return [[home], [replica for replica in ranked if replica != home]]
    fewest = holdings.missing(ranked[0], names)
    best = [replica for replica in ranked if holdings.missing(replica, names) == fewest][:2]
    return [best, [replica for replica in ranked if replica not in best]]
