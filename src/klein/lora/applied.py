"""The LoRAs a pipeline applies to its transformer: one set merged into the weights (`set`), and LoRAs loaded
by name (`load`) that requests apply unmerged from adapter slots, each request its own set
(docs/design/lora.md). One process only: merging keeps the original kernels on the host, and no process
can read another's shards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx

from klein.errors import InputError
from klein.lora.files import LoraInfo
from klein.lora.loading import lora_updates, read_lora
from klein.lora.merge import MergedWeights
from klein.lora.slots import AdapterSlots
from klein.models import layers, products
from klein.models.transformer_config import TransformerConfig


class Loras:
    """The LoRAs of the transformer `weights()` brings to the device (`() -> (graphdef, state)`); adapter
    slots are placed on jax's first device, or replicated over `mesh`."""

    def __init__(self, cfg: TransformerConfig, dtype, weights: Callable, mesh=None, changed=lambda: None):
        self.cfg, self.mesh = cfg, mesh
        self._changed = changed
        """Told when a merge changed the weights on the device (a host copy of them is then stale)."""
        self.weights = MergedWeights(
            lambda: weights()[1], dtype, lambda: layers.block_formats(nnx.merge(*weights()))
        )
        self._model = lambda: nnx.merge(*weights())
        self.slots = AdapterSlots(cfg, dtype, self._place, self._dense)
        """LoRAs loaded by name, applied unmerged by the requests that name them."""

    def set(self, loras: Sequence = ()) -> tuple[LoraInfo, ...]:
        """Merge exactly `loras` (specs as `read_lora` takes them, with scales), in place of the set before;
        every file is read and checked before any weight changes. Returns them as merged, with scales."""
        if loras:
            _one_process()
        read = [read_lora(spec) for spec in loras]
        try:
            self.weights.merge(
                [(update, lora.info.scale) for lora in read for update in lora_updates(lora, self.cfg)]
            )
        finally:
            self._changed()
        self.slots.reweighted()
        return tuple(lora.info for lora in read)

    def load(self, name: str, lora) -> LoraInfo:
        """Read the LoRA `lora` names under `name`, for requests to apply unmerged."""
        _one_process()
        return self.slots.load(name, lora)

    def rows(self, sets: Sequence[Sequence], per_set: int = 1) -> tuple[dict, np.ndarray] | None:
        """(bank, rows float32[images, S * R + 2 S]) for `per_set` images under each set of unmerged LoRAs
        (`LoraUse`s) of `sets`, one row per image; None when no set names any."""
        if not any(sets):
            return None
        return self.slots.prepare([uses for uses in sets for _ in range(per_set)])

    def used(self, sets: Sequence[Sequence]) -> tuple[tuple[LoraInfo, ...], ...]:
        """Each set of unmerged LoRAs as what ran: the files' `LoraInfo`s, at the strengths used."""
        return tuple(
            tuple(dataclasses.replace(self.slots.info(use.name), scale=use.scale) for use in uses)
            for uses in sets
        )

    def _dense(self):
        """`(path, layer) -> float32[O, I]`: a Linear's weight in use, as its product multiplies it."""
        linears = dict(nnx.iter_modules(self._model()))

        def dense(path: tuple, layer: int | None):
            stored = linears[path].stored()
            if layer is not None:
                scale = stored.scale if stored.scale is None else stored.scale[layer]
                stored = dataclasses.replace(stored, array=stored.array[layer], scale=scale)
            return products.dense(jax.tree.map(_on_device, stored))

        return dense

    def _place(self, array: np.ndarray) -> jax.Array:
        if self.mesh is None:
            return jax.device_put(array, jax.local_devices()[0])
        return jax.device_put(array, jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))


def _on_device(array: jax.Array) -> jax.Array:
    """`array`, moved to the device memory of its devices if it is in host memory (residency `stream`)."""
    if array.sharding.memory_kind == "pinned_host":
        return jax.device_put(array, array.sharding.with_memory_kind("device"))
    return array


def _one_process() -> None:
    if jax.process_count() > 1:
        raise InputError("LoRAs on a multi-process run are not supported yet; run on one host")
