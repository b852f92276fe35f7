"""Adapters loaded by name for unmerged products (`klein.models.adapters`), held on the device in a fixed
number of adapter slots, the least recently used giving way (docs/design/lora.md, "LoRA per request"). Every
kind has its place in a slot: a LoRA's factors (and a LoHa's, as its exact low-rank product) in the low-rank
columns, a LoKr's two Kronecker factors, and DoRA's magnitude with the statistics of its update against the
weights in use, from which the program forms the gain of each row's strength.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable, Sequence

import numpy as np

from klein.errors import InputError
from klein.lora import kinds
from klein.lora.dora import row_statistics
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
class Part:
    """An adapter's update on one layer of a Linear, as a slot holds it: low-rank factors `down`
    float32[I, r] and `up` float32[r, O] (r = 0 for none), the trainer's scale folded into `down`; Kronecker
    terms, summed: (`w1` float32[a, b], scale folded; `w2` float32[c, d]) (a LoKr on a part of a fused
    module may be a few, `kinds.Kronecker.row_terms`); DoRA's `magnitude` float32[O], or None."""

    down: np.ndarray
    up: np.ndarray
    kron: tuple[tuple[np.ndarray, np.ndarray], ...] = ()
    magnitude: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class Loaded:
    """An adapter read and mapped for unmerged products: its `Part` per (Linear path, layer), and its kind
    as users name it (LoRA, LoHa, LoKr, DoRA; joined for a file mixing them)."""

    info: LoraInfo
    parts: dict[tuple, Part]
    kind: str


@dataclasses.dataclass(frozen=True)
class Layout:
    """The bank's shapes for a set of adapters: the paths with low-rank columns and the slot rank; the
    Kronecker groups per path, one per factor shape: (terms, a, b, c, d); the paths with DoRA; and the
    slot count."""

    low: frozenset
    rank: int
    kron: tuple[tuple[tuple, tuple[tuple[int, int, int, int, int], ...]], ...]
    dora: frozenset
    slots: int


_SLOT_AXIS = {"w1": -4, "w2": -4, "cross": -2, "square": -2, "magnitude": -2, "dora": -1}
"""The slot axis of each part of a bank that has one, by name (`w1_g` as `w1`; `klein.models.adapters`)."""
_FACTORS = ("down", "up", "w1", "w2")
"""The parts held in the bank's dtype (the others, DoRA's, in float32)."""


class AdapterSlots:
    """Named adapters and the device bank of their slots. `place(array)` puts a host array where the
    transformer's programs read it (the device, or replicated over a mesh); `weights()` gives the weights in
    use as `(path, layer) -> float32[O, I]` (dequantised, with any merged LoRAs), for DoRA's statistics."""

    def __init__(self, cfg: TransformerConfig, dtype, place: Callable, weights: Callable | None = None):
        self.cfg, self.dtype, self._place, self._weights = cfg, np.dtype(dtype), place, weights
        self.max_slots, self.budget = 4, None  # `limit` sets a budget of device bytes
        self._loaded: dict[str, Loaded] = {}
        self._resident: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recently used first
        self._host: dict[tuple, dict[str, np.ndarray]] | None = None
        self._device = None
        # DoRA: ||W_o||^2 per (path, layer), and per adapter (<W_o, D_o>, ||D_o||^2) per (path, layer)
        self._norms: dict[tuple, np.ndarray] = {}
        self._statistics: dict[str, dict[tuple, tuple[np.ndarray, np.ndarray]]] = {}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._loaded)

    @property
    def resident(self) -> tuple[str, ...]:
        """The names whose factors are in a slot now."""
        return tuple(self._resident)

    def release(self, name: str) -> None:
        """Give up `name`'s slot: the next batch that uses it writes it into a slot again, as a first use."""
        self._resident.pop(name, None)

    def info(self, name: str) -> LoraInfo:
        return self._loaded[name].info

    def kind(self, name: str) -> str:
        """The kind of the adapter `name` (LoRA, LoHa, LoKr, DoRA, or several joined by '+')."""
        return self._loaded[name].kind

    def load(self, name: str, spec) -> LoraInfo:
        """Read the adapter at `spec` (a path, as `read_lora` takes it) under `name` (in place of one loaded
        under that name before)."""
        if not isinstance(name, str) or not name:
            raise InputError(f"a loaded LoRA needs a non-empty name, got {name!r}")
        read = read_lora(spec)
        info = dataclasses.replace(read.info, name=name, scale=1.0)
        lora = _loaded(info, lora_updates(read, self.cfg))
        others = {k: v for k, v in self._loaded.items() if k != name}
        loras = {**others, name: lora}
        self._check_fits(loras.values(), self.budget, f"LoRA {name!r}")
        statistics = self._dora_statistics(lora)
        self._loaded = loras
        self._statistics = {k: v for k, v in self._statistics.items() if k in loras}
        if statistics:
            self._statistics[name] = statistics
        self._reset()
        return lora.info

    def reweighted(self) -> None:
        """The weights changed (another set of LoRAs merged): DoRA's statistics follow them."""
        self._norms.clear()
        self._statistics = {}
        for name, lora in self._loaded.items():
            statistics = self._dora_statistics(lora)
            if statistics:
                self._statistics[name] = statistics
        self._reset()

    def limit(self, budget: int) -> None:
        """Bound the slots' device bytes by `budget` (fewer slots, at least one, or an `InputError`)."""
        self._check_fits(self._loaded.values(), budget, "the LoRAs loaded")
        self.budget = budget
        self._reset()

    def _check_fits(self, loras, budget: int | None, what: str) -> None:
        layout = self._layout(loras, None)
        one = self._bytes(layout, 1)
        if budget is not None and one > budget:
            raise InputError(
                f"{what}: one adapter slot takes {one / 2**20:.1f} MiB, more than the {budget / 2**20:.1f} MiB "
                "for adapters; raise the budget (--lora-bytes) or offer LoRAs of lower rank"
            )

    @property
    def slots(self) -> int:
        return self._layout(self._loaded.values(), self.budget).slots

    @property
    def rank(self) -> int:
        return self._layout(self._loaded.values(), self.budget).rank

    @property
    def placed(self) -> bool:
        """Whether the bank is on the device now."""
        return self._device is not None

    @property
    def device_bytes(self) -> int:
        """Bytes the bank takes on the device once used (0 with nothing loaded)."""
        layout = self._layout(self._loaded.values(), self.budget)
        return self._bytes(layout, layout.slots)

    def prepare(self, sets: Sequence[Sequence]) -> tuple[dict, np.ndarray]:
        """(bank, rows float32[len(sets), S * R + 2 S]) for a batch whose row i uses the adapters `sets[i]`
        (`klein.request.loras.LoraUse`s): their slots filled, the least recently used given up. A row holds
        each slot's strength over its R low-rank columns, then each slot's strength, then 1 for each slot it
        uses (`klein.models.adapters`)."""
        needed = self.check_batch(sets)
        layout = self._layout(self._loaded.values(), self.budget)
        for name in needed:
            self._hold(name, needed, layout)
        if self._device is None:
            self._device = {
                path: {part: self._place(self._stored(array, path, part)) for part, array in arrays.items()}
                for path, arrays in self._host.items()
            }
        rank, count = layout.rank, layout.slots
        rows = np.zeros((len(sets), count * (rank + 2)), np.float32)
        for row, uses in zip(rows, sets, strict=True):
            for use in uses:
                slot = self._resident[use.name]
                row[slot * rank : (slot + 1) * rank] += np.float32(use.scale)
                row[count * rank + slot] += np.float32(use.scale)
                row[count * (rank + 1) + slot] = 1
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

    def _hold(self, name: str, needed: list[str], layout: Layout) -> None:
        if name in self._resident:
            self._resident.move_to_end(name)
            return
        if self._host is None:
            self._host = self._empty(layout)
        taken = set(self._resident.values())
        free = [slot for slot in range(layout.slots) if slot not in taken]
        if not free:
            evicted = next(other for other in self._resident if other not in needed)
            free = [self._resident.pop(evicted)]
        self._write(name, free[0], layout)
        self._resident[name] = free[0]
        self._device = None

    def _write(self, name: str, slot: int, layout: Layout) -> None:
        rank, groups = layout.rank, dict(layout.kron)
        columns = slice(slot * rank, (slot + 1) * rank)
        for arrays in self._host.values():
            for part, array in arrays.items():
                if part == "down":
                    array[..., columns] = 0
                elif part == "up":
                    array[..., columns, :] = 0
                elif part.split("_")[0] in _SLOT_AXIS:
                    np.moveaxis(array, _SLOT_AXIS[part.split("_")[0]], 0)[slot] = 0
        statistics = self._statistics.get(name, {})
        for (path, layer), part in self._loaded[name].parts.items():
            arrays, at = self._host[path], () if layer is None else (layer,)
            r = part.down.shape[1]
            if r:
                arrays["down"][(*at, slice(None), slice(slot * rank, slot * rank + r))] = part.down
                arrays["up"][(*at, slice(slot * rank, slot * rank + r), slice(None))] = part.up
            group = {tuple(shape): g for g, (_, *shape) in enumerate(groups.get(path, ()))}
            terms = Counter()
            for w1, w2 in part.kron:
                g = group[(*w1.shape, *w2.shape)]
                arrays[f"w1_{g}"][(*at, slot, terms[g])], arrays[f"w2_{g}"][(*at, slot, terms[g])] = w1, w2
                terms[g] += 1
            if part.magnitude is not None:
                arrays["norm"][at] = self._norms[(path, layer)]
                arrays["cross"][(*at, slot)], arrays["square"][(*at, slot)] = statistics[(path, layer)]
                arrays["magnitude"][(*at, slot)] = part.magnitude
                arrays["dora"][(*at, slot)] = 1

    def _empty(self, layout: Layout) -> dict[tuple, dict[str, np.ndarray]]:
        host: dict[tuple, dict[str, np.ndarray]] = defaultdict(dict)
        count, k = layout.slots, layout.rank * layout.slots
        for path in layout.low:
            *layers, d_in, d_out = kernel_shape(self.cfg, (*path, "kernel"))
            host[path] |= {
                "down": np.zeros((*layers, d_in, k), np.float32),
                "up": np.zeros((*layers, k, d_out), np.float32),
            }
        for path, groups in layout.kron:
            layers = kernel_shape(self.cfg, (*path, "kernel"))[:-2]
            for g, (terms, a, b, c, d) in enumerate(groups):
                host[path] |= {
                    f"w1_{g}": np.zeros((*layers, count, terms, a, b), np.float32),
                    f"w2_{g}": np.zeros((*layers, count, terms, c, d), np.float32),
                }
        for path in layout.dora:
            *layers, _, d_out = kernel_shape(self.cfg, (*path, "kernel"))
            host[path] |= {"norm": np.ones((*layers, d_out), np.float32)}
            host[path] |= {
                part: np.zeros((*layers, count, d_out), np.float32)
                for part in ("cross", "square", "magnitude")
            }
            host[path]["dora"] = np.zeros((*layers, count), np.float32)
        return {path: host[path] for path in sorted(host)}

    def _stored(self, array: np.ndarray, path: tuple, part: str):
        """A part as the device holds it: factors in the bank's dtype, DoRA's statistics in float32; a
        stack's as its bits (`klein.models.stacks`)."""
        values = array.astype(self.dtype) if part.split("_")[0] in _FACTORS else array
        stacked = len(kernel_shape(self.cfg, (*path, "kernel"))) == 3
        return as_bits(values) if stacked else values

    def _layout(self, loras, budget: int | None) -> Layout:
        """The bank's `Layout` for `loras`, with as many slots as `budget` allows (at most `max_slots`)."""
        loras = list(loras)
        parts = [(key, part) for lora in loras for key, part in lora.parts.items()]
        low = frozenset(path for (path, _), part in parts if part.down.shape[1])
        largest = max((part.down.shape[1] for _, part in parts), default=0)
        rank = -(-largest // RANK_STEP) * RANK_STEP
        kron = defaultdict(dict)  # path -> (a, b, c, d) -> terms
        for (path, _), part in parts:
            for shape, terms in Counter((*w1.shape, *w2.shape) for w1, w2 in part.kron).items():
                kron[path][shape] = max(kron[path].get(shape, 0), terms)
        kron = {
            path: tuple((t, *shape) for shape, t in sorted(shapes.items())) for path, shapes in kron.items()
        }
        dora = frozenset(path for (path, _), part in parts if part.magnitude is not None)
        layout = Layout(low, rank, tuple(sorted(kron.items())), dora, self.max_slots)
        count = self.max_slots
        if budget is not None and parts:
            count = max(
                (n for n in range(1, self.max_slots + 1) if self._bytes(layout, n) <= budget), default=0
            )
        return dataclasses.replace(layout, slots=count)

    def _bytes(self, layout: Layout, slots: int) -> int:
        total, wide = 0, np.dtype(np.float32).itemsize

        def shape(path):
            *layers, d_in, d_out = kernel_shape(self.cfg, (*path, "kernel"))
            return int(np.prod(layers, dtype=np.int64)), d_in, d_out

        for path in layout.low:
            layers, d_in, d_out = shape(path)
            total += layers * (d_in + d_out) * layout.rank * slots * self.dtype.itemsize
        for path, groups in layout.kron:
            for terms, a, b, c, d in groups:
                total += shape(path)[0] * slots * terms * (a * b + c * d) * self.dtype.itemsize
        for path in layout.dora:
            layers, _, d_out = shape(path)
            total += layers * (d_out + slots * (3 * d_out + 1)) * wide
        return total

    def _dora_statistics(self, lora: Loaded) -> dict[tuple, tuple[np.ndarray, np.ndarray]]:
        """(<W_o, D_o>, ||D_o||^2) float32[O] per (path, layer) of `lora`'s DoRA parts, against the weights
        in use (and ||W_o||^2 kept in `_norms`), formed on the device."""
        doras = {key: part for key, part in lora.parts.items() if part.magnitude is not None}
        if not doras:
            return {}
        if self._weights is None:
            raise InputError(f"LoRA {lora.info.name!r}: DoRA per request needs the model's weights")
        weight = self._weights()
        out = {}
        for key, part in doras.items():
            norm, cross, square = row_statistics(weight(*key), part.down, part.up, part.kron)
            self._norms[key], out[key] = norm, (cross, square)
        return out

    def _reset(self) -> None:
        """Forget the bank: its shapes may have changed; slots are filled again as requests use them."""
        self._resident.clear()
        self._host = self._device = None


def _loaded(info: LoraInfo, updates) -> Loaded:
    """The parts of an adapter's updates (`klein.lora.targets.Update`), grouped by (Linear path, layer);
    an `InputError` where one layer's updates cannot share a slot."""
    grouped = defaultdict(list)
    for update in updates:
        grouped[(update.path[:-1], update.layer)].append(update)
    parts, found = {}, set()
    for (path, layer), group in grouped.items():
        where = f"LoRA {info.name!r}, {'.'.join(map(str, path))}" + (
            "" if layer is None else f" layer {layer}"
        )
        krons = [u for u in group if isinstance(u.form, kinds.Kronecker)]
        doras = [u for u in group if u.magnitude is not None]
        if doras and len(group) > 1:
            raise InputError(
                f"{where}: a DoRA update and another on one layer; merge this LoRA (--lora) instead"
            )
        lows = [
            (u.form.low_rank(), np.float32(u.scale)) for u in group if not isinstance(u.form, kinds.Kronecker)
        ]
        d_out, d_in = group[0].form.shape
        down = np.concatenate([np.zeros((d_in, 0), np.float32)] + [(f.down * s).T for f, s in lows], axis=1)
        up = np.concatenate([np.zeros((0, d_out), np.float32)] + [f.up.T for f, _ in lows], axis=0)
        kron = tuple((u.form.w1 * np.float32(u.scale), u.form.w2) for u in krons)
        magnitude = doras[0].magnitude if doras else None
        parts[(path, layer)] = Part(down, up, kron, None if magnitude is None else np.float32(magnitude))
        found |= {u.form.name for u in group}
        found |= {"DoRA"} if doras else set()
    return Loaded(info, parts, _kind(found))


def _kind(found: set[str]) -> str:
    if "DoRA" in found and found - {"DoRA"} == {"LoRA"}:
        return "DoRA"
    return "+".join(sorted(found - {"DoRA"}) + ["DoRA"] * ("DoRA" in found)) or "LoRA"
