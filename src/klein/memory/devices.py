"""Devices `klein plan --device NAME` knows: their memory and the 8-bit products they multiply, so that a
plan for a card nobody here owns is the plan `klein generate` would make on it.

Plain data, no jax (`klein --help` lists the names). A card's memory is its nominal size less
`RESERVED_GIB` that the driver and runtime keep; its `compute` is what `--compute auto` picks on it
(`klein.models.products.compute_for`): FP8 from compute capability 8.9 (Ada, Hopper, Blackwell), INT8 on
older NVIDIA cards and on TPU v5e / v6e / v5p.

A device given by its memory alone (`klein plan --device-memory 12GB`) means what a card of that memory
means here: its memory as the box counts it, GB as memory is sold (JEDEC's: 2^30 bytes, so 12GB is the
12 GiB a 12 GB card has), less the same `RESERVED_GIB`; and `--compute auto` plans it with 8-bit
products, as every GPU and TPU above multiplies (fp8 and int8 both keep a block weight in one byte, so
the plan is the same for either). A size and the name of a card of that size give the same plan.
"""

from __future__ import annotations

import dataclasses
import difflib
import re

from klein.errors import InputError

RESERVED_GIB = 1


@dataclasses.dataclass(frozen=True)
class Device:
    memory_gib: int
    """Nominal memory, GB as the vendor counts it on the box (taken as GiB, less `RESERVED_GIB`)."""
    compute: str
    """What `--compute auto` multiplies the blocks in there: "fp8" or "int8"."""
    capability: str = ""
    """An NVIDIA card's compute capability (what `compute` follows from)."""


def _nvidia(memory_gib: int, capability: str) -> Device:
    major, minor = (int(n) for n in capability.split("."))
    return Device(memory_gib, "fp8" if (major, minor) >= (8, 9) else "int8", capability)


DEVICES = {
    # 8 and 12 GB consumer cards: what most people who download a quantized file own.
    "rtx-3060-ti": _nvidia(8, "8.6"),
    "rtx-3070": _nvidia(8, "8.6"),
    "rtx-4060": _nvidia(8, "8.9"),
    "rtx-4060-ti": _nvidia(8, "8.9"),
    "rtx-5060": _nvidia(8, "12.0"),
    "rtx-3080": _nvidia(10, "8.6"),
    "rtx-3060": _nvidia(12, "8.6"),
    "rtx-3080-12gb": _nvidia(12, "8.6"),
    "rtx-4070": _nvidia(12, "8.9"),
    "rtx-4070-super": _nvidia(12, "8.9"),
    "rtx-4070-ti": _nvidia(12, "8.9"),
    "rtx-5070": _nvidia(12, "12.0"),
    "rtx-4060-ti-16gb": _nvidia(16, "8.9"),
    "rtx-4080": _nvidia(16, "8.9"),
    "rtx-5080": _nvidia(16, "12.0"),
    "rtx-3090": _nvidia(24, "8.6"),
    "rtx-4090": _nvidia(24, "8.9"),
    "rtx-5090": _nvidia(32, "12.0"),
    "l4": _nvidia(24, "8.9"),
    "a100-40gb": _nvidia(40, "8.0"),
    "a100-80gb": _nvidia(80, "8.0"),
    "h100-80gb": _nvidia(80, "9.0"),
    "h200": _nvidia(141, "9.0"),
    "tpu-v5e": Device(16, "int8"),
    "tpu-v6e": Device(32, "int8"),
    "tpu-v5p": Device(95, "int8"),
}


GIVEN_COMPUTE = "int8"
"""What `--compute auto` is planned as on a device given by its memory: 8-bit products (fp8 or int8, as
the device multiplies; the same bytes either way)."""


def limit(name: str) -> int:
    """Bytes `name` leaves for klein."""
    return usable(DEVICES[name].memory_gib * 2**30)


def usable(memory: int) -> int:
    """Bytes a device of `memory` bytes (as the box counts them) leaves for klein: less `RESERVED_GIB`."""
    return memory - RESERVED_GIB * 2**30


def find(name: str) -> str:
    """The device table's name for `name`, read without case, spaces or punctuation ("RTX 4090", "rtx4090":
    "rtx-4090"), or the one name it is part of ("h100": "h100-80gb"); an `InputError` naming the nearest
    names otherwise."""
    wanted = _plain(name)
    plain = {_plain(known): known for known in DEVICES}
    around = [p for p in plain if wanted and wanted in p]
    if wanted in plain or len(around) == 1:
        return plain[wanted if wanted in plain else around[0]]
    # Names around the one typed ("3060") or inside it ("rtx4090ti") first, then the most alike.
    inside = sorted(around + [p for p in plain if wanted and p in wanted], key=lambda p: _unlike(p, wanted))
    alike = difflib.get_close_matches(wanted, list(plain), n=3, cutoff=0.6)
    close = [plain[p] for p in dict.fromkeys(inside + alike)]
    hint = (
        f"did you mean {' or '.join(close[:3])}?" if close else "klein plan --help lists the devices it knows"
    )
    raise InputError(f"unknown device {name!r:.40}; {hint}")


def _unlike(a: str, b: str) -> float:
    return -difflib.SequenceMatcher(None, a, b).ratio()


def _plain(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def listing() -> str:
    """The devices for `--help`, a line per memory size: "  8 GB: rtx-3060-ti (int8), ..."."""
    sizes: dict[int, list[str]] = {}
    for name, device in DEVICES.items():
        sizes.setdefault(device.memory_gib, []).append(f"{name} ({device.compute})")
    return "\n".join(f"  {size:>3} GB: {', '.join(names)}" for size, names in sorted(sizes.items()))
