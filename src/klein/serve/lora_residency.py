"""Which LoRAs sit in the adapter slots, as each API key may know it. A LoRA another key brought to a slot
would make a key's first request of it faster than a cold one, telling it what the other key uses; so a
key's first use of a LoRA resident for others writes it into its slot again, as a cold use does, and
GET /v1/loras says `resident` of the LoRAs resident for the asking key (docs/serving.md, "Security")."""

from __future__ import annotations

from collections.abc import Iterable


class LoraResidency:
    """Over `adapters` (`klein.lora.slots.AdapterSlots`), called on the worker thread around each job."""

    def __init__(self, adapters):
        self.adapters = adapters
        self._for: dict[str, set[str | None]] = {}
        """Resident LoRA -> the owners whose jobs have used it since it was last written into its slot."""

    def before(self, owner: str | None, names: Iterable[str]) -> None:
        """Before a job of `owner`'s that uses `names`: give up the slot of each that is resident for
        others only."""
        resident = set(self.adapters.resident)
        for name in names:
            if name in resident and owner not in self._for.get(name, ()):
                self.adapters.release(name)  # written again, still resident for those who used it

    def after(self, owner: str | None, names: Iterable[str]) -> None:
        """After that job (done or not): `names` are resident for `owner`; those evicted for no one."""
        resident = set(self.adapters.resident)
        self._for = {name: owners for name, owners in self._for.items() if name in resident}
        for name in names:
            if name in resident:
                self._for.setdefault(name, set()).add(owner)

    def resident_for(self, owner: str | None) -> set[str]:
        return {name for name, owners in self._for.items() if owner in owners}
