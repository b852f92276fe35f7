"""The bytes a request may add to a pipeline's loaded weights, and whether a request fits them: admission
as a pipeline runs it, before any device work (docs/design.md, "Admission").

The bytes are the first of: a limit the pipeline is given (`pipe.memory_limit`); the memory free when the
pipeline took it as its own (`own`: a server, before its first job) less what its caches have come to
hold; what the device has free now. Free memory counts the weights on the device now, and the residency
policy may hold more or fewer while a request runs, so those are added back and the policy's taken
instead. A cap (`pipe.memory_cap`, `LoadOptions.memory_cap`) bounds the bytes beside the policy's weights
and, on a CPU, klein's own process.
"""

from __future__ import annotations

from collections.abc import Callable

from klein import sharding
from klein.memory import admission, plan, process


def planning_mesh(mesh):
    """The shape of `mesh` (None: one device), as the planner reads it."""
    return mesh.abstract_mesh if mesh is not None else sharding.abstract_mesh("single")


def estimates(models, mesh, work: plan.Workload, itemsize: int) -> tuple[plan.RequestMemory, ...]:
    """(plain decode, tiled decode) estimates of `work` for the configs of `models` (anything with a
    `config`, `text_config` and `vae_config`: a pipeline, or the located checkpoint it loads) on `mesh`
    (`klein.memory.plan.request_memory`)."""
    programs = plan.programs_on(sharding.local_devices(mesh)[0].platform, itemsize)
    return tuple(
        plan.request_memory(
            models.config,
            models.text_config,
            models.vae_config,
            planning_mesh(mesh),
            work,
            itemsize,
            tiled_decode=tiled,
            programs=programs,
        )
        for tiled in (False, True)
    )


class Budget:
    """Admission for the models of `models` on `mesh`, computing with `itemsize`-byte floats. `weights()`:
    (weight bytes on the device now, weight bytes the residency policy holds while a request runs)."""

    def __init__(self, models, mesh, itemsize: int, weights: Callable[[], tuple[int, int]]):
        self.models, self.mesh, self.itemsize, self._weights = models, mesh, itemsize, weights
        self._owned: tuple[int, tuple, str] | None = None
        """With `own`: (bytes for requests and caches, the caches counted against them, whence)."""

    def own(self, caches) -> None:
        """Judge every later request against the memory free now, less what `caches` (`ByteBudgetCache`s,
        or None) come to hold."""
        caches = tuple({id(c): c for c in caches if c is not None}.values())
        free, where = self._free()
        held = sum(cache.bytes for cache in caches)
        self._owned = (free + held, caches, f"{where} when the server started, less its caches")

    def _free(self) -> tuple[int, str]:
        """(bytes a request may use beside the weights the residency policy holds, where from), now."""
        free, where = admission.available_bytes(sharding.local_devices(self.mesh))
        now, held = self._weights()
        return free + now - held, where

    def room(self, limit: int | None = None, cap: int | None = None) -> tuple[int, str]:
        """(bytes a request may use beside the weights, where that figure comes from), given a `limit` on
        them and a `cap` on all klein holds per device (bytes, or None)."""
        if limit is not None:
            return limit, "allowed (memory_limit)"
        if self._owned is not None:
            budget, caches, where = self._owned
            room = budget - sum(cache.bytes for cache in caches)
        else:
            room, where = self._free()
        if cap is None:
            return room, where
        own = process.footprint(sharding.local_devices(self.mesh)[0].platform)
        return admission.under_cap(cap, self._weights()[1], own, room, where)

    def admit(
        self, work: plan.Workload, limit=None, cap=None, adapters: int = 0, placed: bool = False
    ) -> bool:
        """Refuse `work` if it cannot fit the `room(limit, cap)` (`klein.memory.admission.check`); True when
        only the tiled decoder makes it fit. `adapters`: the bytes of the adapter slots of unmerged LoRAs
        the request is charged, `placed` when they are on the device already, where a live reading of
        free memory counts them."""
        room, where = self.room(limit, cap)
        if not (placed and limit is None and self._owned is None):
            room -= adapters
        if estimates(self.models, self.mesh, work, self.itemsize)[0].peak <= room:
            return False

        def estimate(work: plan.Workload) -> plan.RequestMemory:  # the tiled decoder's where it is less
            return min(estimates(self.models, self.mesh, work, self.itemsize), key=lambda m: m.peak)

        admission.check(work, estimate, room, where)
        return True
