"""Admission: refuse a request that cannot fit before it allocates anything (docs/design/requests.md,
"Admission"), measuring it with the planner's estimator (`klein.memory.plan.request_memory`) against what
the device has free (`available_bytes`), a memory cap (`under_cap`) or a pipeline's own `Budget`; a
refusal names the smaller forms of the request that would fit (`smaller_requests`).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable

from klein import sharding
from klein.errors import CannotFitError
from klein.memory import plan, process
from klein.memory.plan import RequestMemory, Workload
from klein.models import products
from klein.models.reference_kv8 import INT8 as KV_INT8
from klein.models.vae import PIXELS_PER_TOKEN


def available_bytes(devices) -> tuple[int, str]:
    """(bytes free on the most loaded of this process's `devices`, where that figure comes from)."""
    free = []
    for device in devices:
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            free.append(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    if free:
        return min(free), "free on the device"
    return _host_available(), "of available host memory"


def memory_for_plan(devices, cap: int | None = None) -> tuple[int, str]:
    """(bytes a whole plan may take on the most loaded of `devices`, where from): what is free there, on a
    CPU with what the process holds already of its planned footprint (no more, so that a process holding
    another pipeline is not counted free), or `cap` where that is less."""
    free, where = available_bytes(devices)
    if devices[0].platform == "cpu":
        free += min(process.resident(), process.footprint("cpu"))
        where = "of available host memory, with klein's own"
    if cap is not None and cap < free:
        return cap, "allowed (memory cap)"
    return free, where


def under_cap(cap: int, weights: int, own: int, limit: int, where: str) -> tuple[int, str]:
    """(bytes a request may use, where from) under a memory cap of `cap` bytes: the cap less the `weights`
    the residency policy holds and `own`, klein's own process (on the CPU), or `limit` where that is less.
    The words carry the figures, so that a refusal says what the cap was spent on."""
    left = max(0, cap - weights - own)  # nothing left, rather than less than nothing
    if left >= limit:
        return limit, where
    counted = f"the weights ({gib(weights)})"
    if own:
        counted += (
            f" and klein's own process ({gib(own)} resident: Python, JAX, compiled programs, the tokenizer, "
            "counted as they share the CPU's memory)"
        )
    return left, f"left of the {gib(cap)} memory cap beside {counted}"


def _host_available() -> int:
    available = process.proc_bytes("/proc/meminfo", "MemAvailable")
    if available is not None:
        return available
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check(
    work: Workload,
    estimate: Callable[[Workload], RequestMemory],
    limit: int,
    where: str,
    beyond: Callable[[RequestMemory], int] = operator.attrgetter("peak"),
) -> None:
    """A `CannotFitError` (an `InputError`) when `work`'s memory (`estimate`, the planner's) does not fit
    `limit`: with the estimate, the limit, what to reduce and the largest smaller forms of the same request
    that fit (`smaller_requests`), each with its figure. `beyond`: the bytes of a request's memory that
    `limit` is for (its peak, or less under a residency policy whose turns hold lighter weights:
    `klein.memory.residency.beyond`)."""
    memory = estimate(work)
    peak = beyond(memory)
    if peak <= limit:
        return
    parts = sorted(memory.parts().items(), key=lambda item: -item[1])
    terms = ", ".join(f"{name.replace('_', ' ')} {gib(value)}" for name, value in parts if value)
    fitting = smaller_requests(work, lambda smaller: beyond(estimate(smaller)), limit)
    fits = f"; at this memory these fit: {', '.join(fitting)}" if fitting else ""
    raise CannotFitError(
        f"this request needs about {gib(peak)} of device memory beyond the loaded weights "
        f"({terms}), {gib(peak - limit)} more than the {gib(limit)} {where}; ask for less: smaller "
        f"or fewer images (height, width, num_images_per_prompt) or fewer or smaller references{fits}"
    )


SCALES = (*(k / 8 for k in range(7, 3, -1)), *(2.0**-k for k in range(2, 11)))
"""Smaller sizes tried, as fractions of each side: by eighths to 1/2, then halved down to 1/1024 (a far too
large request, 65536 px a side, comes down to what fits too)."""


def smaller_sides(size: tuple[int, int]) -> list[tuple[int, int]]:
    """`size` (width, height px) at each of `SCALES`, in whole tokens, no smaller than a token."""

    def side(px: int, scale: float) -> int:
        return max(PIXELS_PER_TOKEN, int(px * scale) // PIXELS_PER_TOKEN * PIXELS_PER_TOKEN)

    found = [(side(size[0], scale), side(size[1], scale)) for scale in SCALES]
    return [s for s in dict.fromkeys(found) if s != size]


def smaller_requests(work: Workload, peak_of: Callable[[Workload], int], limit: int) -> list[str]:
    """For a request refused at admission (`check`): the largest of each smaller form of its workload `work`
    whose peak (`peak_of`: the admission's own estimate) fits `limit`, in words any front end shows: a
    smaller size, fewer images, smaller references or none."""
    images = _most(work.images - 1, lambda n: peak_of(dataclasses.replace(work, images=n)) <= limit)
    ladders = [
        [(dict(height=h, width=w), f"{w}x{h} px") for w, h in smaller_sides((work.width, work.height))],
        [(dict(images=images), f"{images} image{'s' * (images > 1)} at a time")] if images else [],
    ]
    if work.reference_tokens:
        scales = [(int(work.reference_tokens * k * k), k) for k in SCALES if k >= 1 / 8]
        ladders.append(
            [(dict(reference_tokens=t), f"references at {k:.0%} of their sides") for t, k in scales]
        )
        ladders.append([(dict(reference_tokens=0), "no references")])
    found = []
    for ladder in ladders:
        for change, words in ladder:
            peak = peak_of(dataclasses.replace(work, **change))
            if peak <= limit:
                found.append(f"{words} ({gib(peak)})")
                break
    return found


def _most(most: int, fits: Callable[[int], bool]) -> int:
    """The largest n in 1..`most` that `fits` (which holds up to some n and not beyond), 0 if none."""
    low, high = 0, most
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def planning_mesh(mesh):
    """The shape of `mesh` (None: one device), as the planner reads it."""
    return mesh.abstract_mesh if mesh is not None else sharding.abstract_mesh("single")


def estimates(
    models, mesh, work: plan.Workload, itemsize: int, compute: str = products.BF16, table_on_host=None
) -> tuple[plan.RequestMemory, ...]:
    """(plain decode, tiled decode) estimates of `work` for the configs of `models` (a pipeline, or the
    located checkpoint it loads) on `mesh`, the blocks' products made as `compute` says, the text encoder's
    token table in host memory where `table_on_host` (None: as the pipeline `models` keeps it)
    (`klein.memory.plan.request_memory`)."""
    platform = sharding.local_devices(mesh)[0].platform
    configs, shape = (models.config, models.text_config, models.vae_config), planning_mesh(mesh)
    if table_on_host is None:
        table_on_host = getattr(models, "text_table", None) is not None
    return tuple(
        plan.request_memory(
            *configs, shape, work, itemsize, tiled, platform, compute, table_on_host=table_on_host
        )
        for tiled in (False, True)
    )


class Budget:
    """Admission for the models of the pipeline `models` on `mesh`, computing with `itemsize`-byte floats
    and the blocks' products made as its `compute` says. `weights()`: (weight bytes on the device now,
    weight bytes the residency policy holds while a request runs); `beyond(memory)`: the bytes of a
    request's memory it needs beside those (`check`), its peak unless given."""

    def __init__(
        self,
        models,
        mesh,
        itemsize: int,
        weights: Callable[[], tuple[int, int]],
        beyond: Callable[[RequestMemory], int] = operator.attrgetter("peak"),
    ):
        self.models, self.mesh, self.itemsize, self._weights = models, mesh, itemsize, weights
        self._beyond = beyond
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
        """(bytes a request may use beside the weights the residency policy holds, where from), now: free
        memory counts the weights on the device now, which the policy may change while a request runs."""
        free, where = available_bytes(sharding.local_devices(self.mesh))
        now, held = self._weights()
        return free + now - held, where

    def _room(self, limit: int | None = None, cap: int | None = None) -> tuple[int, str]:
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
        return under_cap(cap, self._weights()[1], own, room, where)

    def admit(
        self, work: plan.Workload, limit=None, cap=None, adapters: int = 0, placed: bool = False
    ) -> bool:
        """Refuse `work` if it cannot fit the `_room(limit, cap)` (`check`); True when only the tiled decoder
        makes it fit. `adapters`: the bytes of unmerged LoRAs' slots, `placed` when they are on the device
        already, where a live reading of free memory counts them, as it counts the keys and values of
        references that come prefilled (`Workload.prefilled`)."""
        room, where = self._room(limit, cap)
        live = limit is None and self._owned is None
        if not (placed and live):
            room -= adapters
        plain = estimates(self.models, self.mesh, work, self.itemsize, self.models.compute)[0]
        if work.prefilled and live:
            room += plain.reference_kv
        if self._beyond(plain) <= room:
            return False

        def estimate(work: plan.Workload) -> plan.RequestMemory:  # the tiled decoder's where it is less
            return min(
                estimates(self.models, self.mesh, work, self.itemsize, self.models.compute),
                key=self._beyond,
            )

        check(work, estimate, room, where, self._beyond)
        return True

    def admit_kv(self, work: plan.Workload, kv_dtype: str, *args) -> tuple[bool, plan.Workload]:
        """`admit` (`args` its own after `work`), with a fresh prefill's keys and values as `kv_dtype`
        (`klein.request.loading.KV_DTYPES`) says: "auto" takes int8 only where the compute dtype's do not fit.
        Returns (`admit`'s answer, `work` as admitted); references that come prefilled keep theirs."""
        if not work.cached or work.prefilled or kv_dtype == "dtype":
            return self.admit(work, *args), work
        eight = dataclasses.replace(work, kv_dtype=KV_INT8)
        if kv_dtype == KV_INT8:
            return self.admit(eight, *args), eight
        try:
            return self.admit(work, *args), work
        except CannotFitError as refused:
            try:
                return self.admit(eight, *args), eight
            except CannotFitError:
                raise refused from None

    def prefill_kv(self, references, bucket: bool, kv_dtype: str, limit=None, cap=None) -> str | None:
        """How references encoded apart store their keys and values (`kv_dtype` resolved): under "auto",
        int8 where a request of one image of the first reference's size over them would not fit in the
        compute dtype's, else None (the compute dtype)."""
        if kv_dtype != "auto":
            return KV_INT8 if kv_dtype == KV_INT8 else None
        (height, width), tokens = references.pixel_sizes[0], references.tokens.shape[0]
        work = plan.Workload(1, 1, height, width, tokens, True, False, bucket=bucket, prefilled=True)
        room, _ = self._room(limit, cap)
        memory = min(
            estimates(self.models, self.mesh, work, self.itemsize, self.models.compute), key=self._beyond
        )
        return None if self._beyond(memory) <= room else KV_INT8

    def admit_prefill(
        self, references, bucket: bool, limit=None, cap=None, kv_dtype: str = "dtype"
    ) -> str | None:
        """Refuse the prefill of `references` (`klein.request.references.References`, over their token
        bucket unless `bucket` is False) if its keys and values and its own activations cannot fit the
        `_room(limit, cap)`: references encoded apart (`encode_references`), before any request that will
        use them is known, are judged on what their prefill holds. Returns how it stores its keys and values
        (`kv_dtype` resolved by `prefill_kv`: None or int8)."""
        kv_dtype = self.prefill_kv(references, bucket, kv_dtype, limit, cap)
        (height, width), tokens = references.pixel_sizes[0], references.tokens.shape[0]
        work = plan.Workload(1, 1, height, width, tokens, True, False, bucket=bucket, kv_dtype=kv_dtype)
        room, where = self._room(limit, cap)

        def prefill(work: plan.Workload) -> plan.RequestMemory:
            memory = estimates(self.models, self.mesh, work, self.itemsize, self.models.compute)[0]
            return RequestMemory(
                reference_kv=memory.reference_kv, prefill=memory.prefill, text=0, step=0, decode=0
            )

        check(work, prefill, room, where, self._beyond)
        return kv_dtype


def gib(value: int) -> str:
    """Bytes in a refusal or a suggestion: GiB, or MiB below an eighth of one."""
    return f"{value / 2**30:.2f} GiB" if value >= 2**27 else f"{value / 2**20:.1f} MiB"
