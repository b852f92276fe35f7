"""Admission: refuse a request that cannot fit before it allocates anything (docs/design.md, "Admission").

The request's bytes come from the planner's estimator (`klein.memory.plan.request_memory`, the same one
`klein plan` prints); what the device can give comes from `device.memory_stats()` where the backend
reports it, else (CPU) from the host's available memory; a memory cap (`LoadOptions.memory_cap`) bounds
both.
"""

from __future__ import annotations

from klein.errors import CannotFitError
from klein.memory import process
from klein.memory.plan import RequestMemory


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


def _host_available() -> int:
    available = process.proc_bytes("/proc/meminfo", "MemAvailable")
    if available is not None:
        return available
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check(memory: RequestMemory, limit: int, where: str) -> None:
    """A `CannotFitError` (an `InputError`) with the estimate, the limit and what to reduce when `memory` does not fit."""
    if memory.peak <= limit:
        return
    parts = sorted(memory.parts().items(), key=lambda item: -item[1])
    terms = ", ".join(f"{name.replace('_', ' ')} {_gib(value)}" for name, value in parts if value)
    raise CannotFitError(
        f"this request needs about {_gib(memory.peak)} of device memory beyond the loaded weights "
        f"({terms}), more than the {_gib(limit)} {where}; ask for less: smaller or fewer images "
        f"(height, width, num_images_per_prompt) or fewer or smaller references"
    )


def _gib(value: int) -> str:
    return f"{value / 2**30:.2f} GiB" if value >= 2**27 else f"{value / 2**20:.1f} MiB"
