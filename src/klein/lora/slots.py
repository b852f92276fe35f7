"""LoRAs loaded by name for unmerged products (`klein.models.adapters`), held on the device in a fixed
number of adapter slots, the least recently used giving way (docs/design/lora.md, "LoRA per request").
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Sequence

import numpy as np

from klein.errors import InputError
from klein.lora.files import LoraInfo
from klein.lora.loading import lora_updates, read_lora
from klein.lora.registry import check_known
from klein.lora.targets import kernel_shape
from klein.models.stacks import as_bits
from klein.models.transformer_config import TransformerConfig

RANK_STEP = 8
"""Slot ranks are multiples of this, so that loading a LoRA of a slightly larger rank seldom changes the
bank's shapes (and so the programs)."""


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A LoRA read and mapped for unmerged products: per (Linear path, layer) its factors, the trainer's
    scale folded into `down` float32[I, r]; `up` float32[r, O] (several modules on one layer: ranks joined)."""

    info: LoraInfo
    factors: dict[tuple, tuple[np.ndarray, np.ndarray]]


class AdapterSlots:
    """Named LoRAs and the device bank of their slots. `place(array)` puts a host array where the
    transformer's programs read it (the device, or replicated over a mesh)."""

    def __init__(self, cfg: TransformerConfig, dtype, place: Callable):
        self.cfg, self.dtype, self._place = cfg, np.dtype(dtype), place
        self.max_slots, self.budget = 4, None  # `limit` sets a budget of device bytes
        self._loaded: dict[str, Loaded] = {}
        self._resident: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recently used first
        self._host: dict[tuple, tuple[np.ndarray, np.ndarray]] | None = None
        self._device = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._loaded)

    @property
    def resident(self) -> tuple[str, ...]:
        """The names whose factors are in a slot now."""
        return tuple(self._resident)

    def info(self, name: str) -> LoraInfo:
        return self._loaded[name].info

    def load(self, name: str, spec) -> LoraInfo:
        """Read the LoRA at `spec` (a path, as `read_lora` takes it) under `name` (in place of one loaded
        under that name before)."""
        if not isinstance(name, str) or not name:
            raise InputError(f"a loaded LoRA needs a non-empty name, got {name!r}")
        read = read_lora(spec)
        grouped = defaultdict(list)
        for update in lora_updates(read, self.cfg):
            grouped[(update.path[:-1], update.layer)].append(update)
        factors = {
            key: (
                np.concatenate([(u.form.low_rank().down * np.float32(u.scale)).T for u in updates], axis=1),
                np.concatenate([u.form.low_rank().up.T for u in updates], axis=0),
            )
            for key, updates in grouped.items()
        }
        lora = Loaded(dataclasses.replace(read.info, name=name, scale=1.0), factors)
        loras = {**{k: v for k, v in self._loaded.items() if k != name}, name: lora}
        self._check_fits(loras.values(), self.budget, f"LoRA {name!r}")
        self._loaded = loras
        self._reset()
        return lora.info

    def limit(self, budget: int) -> None:
        """Bound the slots' device bytes by `budget` (fewer slots, at least one, or an `InputError`)."""
        self._check_fits(self._loaded.values(), budget, "the LoRAs loaded")
        self.budget = budget
        self._reset()

    def _check_fits(self, loras, budget: int | None, what: str) -> None:
        paths, rank, _ = self._layout(loras)
        one = self._bytes(paths, rank, 1)
        if budget is not None and one > budget:
            raise InputError(
                f"{what}: one adapter slot takes {one / 2**20:.1f} MiB, more than the {budget / 2**20:.1f} MiB "
                "for adapters; raise the budget (--lora-bytes) or offer LoRAs of lower rank"
            )

    @property
    def slots(self) -> int:
        return self._layout(self._loaded.values())[2]

    @property
    def rank(self) -> int:
        return self._layout(self._loaded.values())[1]

    @property
    def placed(self) -> bool:
        """Whether the bank is on the device now."""
        return self._device is not None

    @property
    def device_bytes(self) -> int:
        """Bytes the bank takes on the device once used (0 with nothing loaded)."""
        paths, rank, slots = self._layout(self._loaded.values())
        return self._bytes(paths, rank, slots)

    def prepare(self, sets: Sequence[Sequence]) -> tuple[dict, np.ndarray]:
        """(bank, rows float32[len(sets), S * R]) for a batch whose row i uses the LoRAs `sets[i]`
        (`klein.request.loras.LoraUse`s): their slots filled, the least recently used given up."""
        needed = self.check_batch(sets)
        paths, rank, slots = self._layout(self._loaded.values())
        for name in needed:
            self._hold(name, needed, paths, rank, slots)
        if self._device is None:
            self._device = {
                path: tuple(self._place(self._stored(a, path)) for a in pair)
                for path, pair in self._host.items()
            }
        rows = np.zeros((len(sets), slots * rank), np.float32)
        for row, uses in zip(rows, sets, strict=True):
            for use in uses:
                slot = self._resident[use.name]
                row[slot * rank : (slot + 1) * rank] += np.float32(use.scale)
        return self._device, rows

    def check_batch(self, sets: Sequence[Sequence]) -> list[str]:
        """The distinct LoRAs of a batch whose rows use `sets`, or an `InputError` if one is not loaded or
        they need more slots than there are."""
        check_known(sets, self.names)
        needed = list(dict.fromkeys(use.name for uses in sets for use in uses))
        if len(needed) > self.slots:
            raise InputError(
                f"{len(needed)} LoRAs at once, more than the {self.slots} adapter slots; run fewer together"
            )
        return needed

    def _hold(self, name: str, needed: list[str], paths, rank: int, slots: int) -> None:
        if name in self._resident:
            self._resident.move_to_end(name)
            return
        if self._host is None:
            self._host = {path: self._empty(path, rank, slots) for path in sorted(paths)}
        taken = set(self._resident.values())
        free = [slot for slot in range(slots) if slot not in taken]
        if not free:
            evicted = next(other for other in self._resident if other not in needed)
            free = [self._resident.pop(evicted)]
        self._write(self._loaded[name], free[0], rank)
        self._resident[name] = free[0]
        self._device = None

    def _write(self, lora: Loaded, slot: int, rank: int) -> None:
        columns = slice(slot * rank, (slot + 1) * rank)
        for down, up in self._host.values():
            down[..., columns] = 0
            up[..., columns, :] = 0
        for (path, layer), (d, u) in lora.factors.items():
            down, up = self._host[path]
            at = () if layer is None else (layer,)
            down[(*at, slice(None), slice(slot * rank, slot * rank + d.shape[1]))] = d
            up[(*at, slice(slot * rank, slot * rank + d.shape[1]), slice(None))] = u

    def _empty(self, path: tuple, rank: int, slots: int) -> tuple[np.ndarray, np.ndarray]:
        *layers, d_in, d_out = kernel_shape(self.cfg, (*path, "kernel"))
        k = rank * slots
        return np.zeros((*layers, d_in, k), np.float32), np.zeros((*layers, k, d_out), np.float32)

    def _stored(self, array: np.ndarray, path: tuple):
        values = array.astype(self.dtype)
        stacked = len(kernel_shape(self.cfg, (*path, "kernel"))) == 3
        return as_bits(values) if stacked else values

    def _layout(self, loras) -> tuple[frozenset, int, int]:
        """(Linear paths, slot rank, slot count) of a bank for `loras`."""
        loras = list(loras)
        paths = frozenset(path for lora in loras for path, _ in lora.factors)
        largest = max((down.shape[1] for lora in loras for down, _ in lora.factors.values()), default=0)
        rank = -(-largest // RANK_STEP) * RANK_STEP
        slots = self.max_slots
        if self.budget is not None and rank:
            slots = min(slots, self.budget // max(self._bytes(paths, rank, 1), 1))
        return paths, rank, int(slots)

    def _bytes(self, paths, rank: int, slots: int) -> int:
        total = 0
        for path in paths:
            *layers, d_in, d_out = kernel_shape(self.cfg, (*path, "kernel"))
            total += int(np.prod(layers, dtype=np.int64)) * (d_in + d_out) * rank * slots
        return total * self.dtype.itemsize

    def _reset(self) -> None:
        """Forget the bank: its shapes may have changed; slots are filled again as requests use them."""
        self._resident.clear()
        self._host = self._device = None
