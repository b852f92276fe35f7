"""Admission: refuse a request that cannot fit before it allocates anything (docs/design.md, "Admission").

The request's bytes come from the planner's estimator (`klein.memory.plan.request_memory`, the same one
`klein plan` prints); what the device can give comes from `device.memory_stats()` where the backend
reports it, else (CPU) from the host's available memory; a memory cap (`LoadOptions.memory_cap`) bounds
both.
"""

from __future__ import annotations

from collections.abc import Callable

from klein.errors import CannotFitError
from klein.memory import process, suggest
from klein.memory.plan import RequestMemory, Workload


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
    """(bytes a whole plan may take on the most loaded of `devices`, where that figure comes from): what is
    free there, on a CPU with the part of the process's planned footprint it holds already (a CPU plan
    counts the process, `klein.memory.process`; no more than that, so that a process holding another
    pipeline is not counted free), or `cap` where that is less."""
    free, where = available_bytes(devices)
    if devices[0].platform == "cpu":
        free += min(process.resident(), process.footprint("cpu"))
        where = "of available host memory, with klein's own"
    if cap is not None and cap < free:
        return cap, "allowed (memory cap)"
    return free, where


def under_cap(cap: int, weights: int, own: int, limit: int, where: str) -> tuple[int, str]:
    """(bytes a request may use, where from) under a memory cap of `cap` bytes: the cap less the `weights`
    the residency policy holds and `own`, klein's own process where it shares the memory the cap bounds
    (`process.footprint`: on the CPU), or `limit` where that is less. The words carry the figures, so that
    a refusal says what the cap was spent on."""
    left = max(0, cap - weights - own)  # nothing left, rather than less than nothing
    if left >= limit:
        return limit, where
    counted = f"the weights ({_gib(weights)})"
    if own:
        counted += (
            f" and klein's own process ({_gib(own)} resident: Python, JAX, compiled programs, the tokenizer, "
            "counted as they share the CPU's memory)"
        )
    return left, f"left of the {_gib(cap)} memory cap beside {counted}"


def _host_available() -> int:
    available = process.proc_bytes("/proc/meminfo", "MemAvailable")
    if available is not None:
        return available
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check(work: Workload, estimate: Callable[[Workload], RequestMemory], limit: int, where: str) -> None:
    """A `CannotFitError` (an `InputError`) when `work`'s memory (`estimate`, the planner's) does not fit
    `limit`: with the estimate, the limit, what to reduce and the largest smaller forms of the same request
    that fit (`klein.memory.suggest.smaller_requests`), each with its figure."""
    memory = estimate(work)
    if memory.peak <= limit:
        return
    parts = sorted(memory.parts().items(), key=lambda item: -item[1])
    terms = ", ".join(f"{name.replace('_', ' ')} {_gib(value)}" for name, value in parts if value)
    fitting = suggest.smaller_requests(work, lambda smaller: estimate(smaller).peak, limit)
    fits = f"; at this memory these fit: {', '.join(fitting)}" if fitting else ""
    raise CannotFitError(
        f"this request needs about {_gib(memory.peak)} of device memory beyond the loaded weights "
        f"({terms}), {_gib(memory.peak - limit)} more than the {_gib(limit)} {where}; ask for less: smaller "
        f"or fewer images (height, width, num_images_per_prompt) or fewer or smaller references{fits}"
    )


def _gib(value: int) -> str:
    return f"{value / 2**30:.2f} GiB" if value >= 2**27 else f"{value / 2**20:.1f} MiB"
