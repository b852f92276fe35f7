"""The devices klein knows, each card or TPU chip once: its memory, compute capability, peaks per precision,
bandwidth and what XLA needs to compile for it. `klein plan --device` and `--target` name a device the same
way, the roofline reads its peaks and bandwidth, the planner its memory, `compute="auto"` its fastest product.

Plain data, no jax (`klein --help` lists the names; `find` says how a name is read). Peaks are dense, per
chip, from the `source` page (the GeForce card's with FP32 accumulation); `GpuTarget`'s are NVIDIA's
published specifications, the H100's and H200's as in XLA's own target specs.
"""

from __future__ import annotations

import dataclasses
import difflib
import re

from klein.errors import InputError

RESERVED_GIB = 1
GIB, GB, TB, MIB = 2**30, 10**9, 1e12, 2**20
BF16, FP8, INT8 = "bf16", "fp8", "int8"
NVFP4, MXFP8 = "nvfp4", "mxfp8"
FP8_FROM = (8, 9)
"""The compute capability of NVIDIA's first FP8 tensor cores (Ada; Hopper and Blackwell after it)."""
BLOCK_SCALED_FROM = (10, 0)
"""The compute capability of NVIDIA's first tensor cores that multiply block-scaled (NVFP4, MXFP8) products
(Blackwell: B200 sm_100, GeForce RTX 50 sm_120)."""
AUTO_SSIM = 0.98
"""The least image SSIM against bf16 a block-scaled product keeps in the quality table (`QUALITY`) for
`auto` to take it."""
QUALITY = {NVFP4: 0.9983, MXFP8: 0.9995}
"""Each block-scaled product's image SSIM against bf16 at klein-4b's width with the real VAE (random
weights, 1 double + 2 single blocks, 512^2 px, 4 steps), as docs/design/checkpoints.md gives it ("Quality of
the low-precision paths", `benchmarks/precision/quality_low_precision.py`)."""
GIVEN_COMPUTE = INT8
"""What `--compute auto` is planned as on a device given by its memory: 8-bit products (fp8 or int8, as
the device multiplies; the same bytes either way), as on every card before Blackwell; on Blackwell nvfp4
keeps its weights in fewer bytes, so such a plan errs on the roomy side there."""


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """What XLA's GPU compiler reads of a card beyond the table's other columns (`klein.aot.gpu_targets`):
    it picks kernels by them."""

    sms: int
    clock_ghz: float
    """Boost clock."""
    l2_bytes: int
    shared_per_sm: int
    shared_per_block_optin: int
    threads_per_sm: int


@dataclasses.dataclass(frozen=True)
class Device:
    """A card or TPU chip; a figure not known here is 0 or empty. Memory, bandwidth and peaks are per chip."""

    name: str
    memory_gib: int
    """As its box says (GB as memory is sold: GiB)."""
    capability: str = ""
    """An NVIDIA card's compute capability ("8.9"); empty for a TPU chip."""
    label: str = ""
    """The device in words, for the roofline and estimates."""
    device_kind: str = ""
    """`jax.Device.device_kind` of its devices."""
    memory_bytes: int = 0
    """What its programs see (what CUDA reports on an NVIDIA card, Google's published HBM for a TPU chip)."""
    bandwidth: float = 0.0
    """Memory bytes per second."""
    bf16_flops: float = 0.0
    fp8_flops: float = 0.0
    """0 also where it has no FP8 units."""
    int8_flops: float = 0.0
    fp4_flops: float = 0.0
    """Block-scaled 4-bit (NVFP4) products; 0 where it has no FP4 units (before Blackwell)."""
    devices_per_chip: int = 1
    """JAX's devices per chip (TPU7x: a device per TensorCore, two a chip)."""
    source: str = ""
    gpu: GpuTarget | None = None
    """XLA's description of an NVIDIA card (`klein plan --target` compiles for the cards that have one)."""
    slice: str = ""
    """A slice of a TPU chip as libtpu names it (its compiler description), the one `klein plan --target` is
    tested with."""

    @property
    def compute(self) -> str:
        """What `--compute auto` multiplies there (`auto_compute`)."""
        return _fastest("gpu" if self.capability else "tpu", self.capability, self.fp8_flops)

    @property
    def limit(self) -> int:
        """Bytes a device of it leaves klein: its box less `RESERVED_GIB`, at most what its programs see."""
        box = usable(self.memory_gib * GIB // self.devices_per_chip)
        return min(box, self.device_memory) if self.memory_bytes else box

    @property
    def device_memory(self) -> int:
        return self.memory_bytes // self.devices_per_chip

    @property
    def device_flops(self) -> float:
        return self.bf16_flops / self.devices_per_chip

    def device_flops_for(self, compute: str) -> float:
        """Peak per device of the products `compute` ("bf16", "fp8", "int8", "nvfp4", "mxfp8": an MX product
        runs at its element type's rate) makes (bf16's where that one is not published)."""
        peaks = {FP8: self.fp8_flops, INT8: self.int8_flops, NVFP4: self.fp4_flops, MXFP8: self.fp8_flops}
        peak = peaks.get(compute) or self.bf16_flops
        return peak / self.devices_per_chip

    @property
    def device_bandwidth(self) -> float:
        return self.bandwidth / self.devices_per_chip


_HOPPER = GpuTarget(132, 1.98, 50 * MIB, 233472, 232448, 2048)
_ADA = dict(shared_per_sm=102400, shared_per_block_optin=101376, threads_per_sm=1536)
_RTX_BLACKWELL = "NVIDIA RTX Blackwell GPU architecture whitepaper"
_TABLE = (
    # 8 and 12 GB consumer cards: what most people who download a quantized file own.
    Device("rtx-3060-ti", 8, "8.6"), Device("rtx-3070", 8, "8.6"), Device("rtx-4060", 8, "8.9"),
    Device("rtx-4060-ti", 8, "8.9"), Device("rtx-5060", 8, "12.0"), Device("rtx-3080", 10, "8.6"),
    Device("rtx-3060", 12, "8.6"), Device("rtx-3080-12gb", 12, "8.6"), Device("rtx-4070", 12, "8.9"),
    Device("rtx-4070-super", 12, "8.9"), Device("rtx-4070-ti", 12, "8.9"),
    # GeForce Blackwell (sm_120, Ada's shared memory and threads per SM): dense peaks with FP32
    # accumulation, FP4 the block-scaled (NVFP4) rate.
    Device("rtx-5070", 12, "12.0", "NVIDIA GeForce RTX 5070", "NVIDIA GeForce RTX 5070", 12227 * MIB,
           672 * GB, 61.7 * TB, 123.5 * TB, 247 * TB, 494 * TB, source=_RTX_BLACKWELL,
           gpu=GpuTarget(48, 2.51, 48 * MIB, **_ADA)),
    Device("rtx-4060-ti-16gb", 16, "8.9"), Device("rtx-4080", 16, "8.9"),
    Device("rtx-5080", 16, "12.0", "NVIDIA GeForce RTX 5080", "NVIDIA GeForce RTX 5080", 16303 * MIB,
           960 * GB, 112.6 * TB, 225.1 * TB, 450.2 * TB, 900.4 * TB, source=_RTX_BLACKWELL,
           gpu=GpuTarget(84, 2.62, 64 * MIB, **_ADA)),
    Device("rtx-3090", 24, "8.6"),
    Device("rtx-4090", 24, "8.9", "NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 4090", 24564 * MIB,
           1008 * GB, 165 * TB, 330 * TB, 661 * TB, source="NVIDIA Ada GPU architecture whitepaper",
           gpu=GpuTarget(128, 2.52, 72 * MIB, **_ADA)),
    Device("rtx-5090", 32, "12.0", "NVIDIA GeForce RTX 5090", "NVIDIA GeForce RTX 5090", 32607 * MIB,
           1792 * GB, 209.5 * TB, 419 * TB, 838 * TB, 1676 * TB, source=_RTX_BLACKWELL,
           gpu=GpuTarget(170, 2.41, 96 * MIB, **_ADA)),
    Device("l4", 24, "8.9"),
    Device("l40s", 48, "8.9", "NVIDIA L40S", "NVIDIA L40S", 46068 * MIB,  # ECC on, as NVIDIA ships it
           864 * GB, 362 * TB, 733 * TB, 733 * TB, source="nvidia.com/en-us/data-center/l40s",
           gpu=GpuTarget(142, 2.52, 96 * MIB, **_ADA)),
    Device("a100-40gb", 40, "8.0"), Device("a100-80gb", 80, "8.0"),
    Device("h100-80gb", 80, "9.0", "NVIDIA H100 SXM", "NVIDIA H100 80GB HBM3", 84942979072, 3.35232 * TB,
           989 * TB, 1979 * TB, 1979 * TB, source="nvidia.com/en-us/data-center/h100", gpu=_HOPPER),
    Device("h200", 141, "9.0", "NVIDIA H200", "NVIDIA H200", 151397597184, 4.8 * TB,
           989 * TB, 1979 * TB, 1979 * TB, source="nvidia.com/en-us/data-center/h200", gpu=_HOPPER),
    # HGX B200's page gives 8 GPUs' sparse peaks: a GPU's dense peak is an eighth of it, halved.
    Device("b200", 180, "10.0", "NVIDIA B200", "NVIDIA B200", 183359 * MIB, 8 * TB, 2250 * TB, 4500 * TB,
           4500 * TB, 9000 * TB, source="nvidia.com/en-us/data-center/hgx",
           gpu=GpuTarget(148, 1.965, 126 * MIB, 233472, 232448, 2048)),
    Device("tpu-v5e", 16, "", "TPU v5e", "TPU v5 lite", 16 * GB, 819 * GB, 197 * TB, int8_flops=394 * TB,
           source="cloud.google.com/tpu/docs/v5e", slice="v5e:2x4"),
    Device("tpu-v6e", 32, "", "TPU v6e (Trillium)", "TPU v6 lite", 32 * GB, 1640 * GB, 918 * TB,
           int8_flops=1836 * TB, source="cloud.google.com/tpu/docs/v6e", slice="v6e:2x4"),
    Device("tpu-v5p", 95, "", "TPU v5p", "TPU v5", 95 * GIB, 2765 * GB, 459 * TB, int8_flops=918 * TB,
           source="cloud.google.com/tpu/docs/v5p", slice="v5p:2x2x1"),
    Device("tpu7x", 192, "", "TPU7x (Ironwood)", "TPU7x", 192 * GIB, 7.37 * TB, 2307 * TB, 4614 * TB,
           devices_per_chip=2, source="cloud.google.com/tpu/docs/tpu7x", slice="tpu7x:2x2x1"),
)  # fmt: skip
DEVICES = {device.name: device for device in _TABLE}
ALIASES = {"h100": "h100-80gb"}
"""Names `klein plan --target` knew its cards by before there was one table; read with a note."""
TARGETS = tuple(name for name, device in DEVICES.items() if device.gpu)
"""The cards `klein plan --target` compiles for, each alone or as NAME:COUNT on one host."""
SLICES = tuple(device.slice for device in _TABLE if device.slice)
"""TPU slices `klein plan --target` is tested with; any name libtpu knows works."""


def auto_compute(device) -> str:
    """What `compute="auto"` picks on the jax `device`: the product its hardware multiplies fastest. On
    Blackwell (`BLOCK_SCALED_FROM`) the block-scaled product the quality table passes
    (`BLOCK_SCALED_AUTO`); FP8 on other GPUs with FP8 tensor cores (`FP8_FROM`) and on TPUs with an FP8
    peak (TPU7x); INT8 on other GPUs and TPUs (v5e / v6e multiply int8 at twice their bf16 rate); bf16
    on CPUs, which have neither (XLA:CPU widens float8 products and its int8 product is slower than its
    bf16 one here, and quantising the activations costs more: docs/design.md)."""
    chip = of_kind(device.device_kind)
    capability = str(getattr(device, "compute_capability", "") or "0.0")
    return _fastest(device.platform, capability, chip.fp8_flops if chip else 0.0)


def auto_pick(ssims: dict[str, float]) -> str:
    """What `auto` multiplies on a card from `BLOCK_SCALED_FROM`, given each block-scaled product's image
    SSIM against bf16: the first of nvfp4 (twice mxfp8's rate, half its bytes) and mxfp8 that keeps
    `AUTO_SSIM`, else fp8."""
    return next((compute for compute in (NVFP4, MXFP8) if ssims.get(compute, 0) >= AUTO_SSIM), FP8)


BLOCK_SCALED_AUTO = auto_pick(QUALITY)
"""What `auto` multiplies on a card from `BLOCK_SCALED_FROM`, by the quality table (`QUALITY`)."""


def _fastest(platform: str, capability: str, fp8_flops: float) -> str:
    if platform == "gpu":
        version = tuple(int(n) for n in capability.split(".")[:2])
        if version >= BLOCK_SCALED_FROM:
            return BLOCK_SCALED_AUTO
        return FP8 if version >= FP8_FROM else INT8
    if platform == "tpu":
        return FP8 if fp8_flops else INT8
    return BF16


def of_kind(device_kind: str) -> Device | None:
    """The device whose devices report `device_kind` (`jax.Device.device_kind`), if the table has it."""
    return next((device for device in _TABLE if device.device_kind == device_kind), None)


def usable(memory: int) -> int:
    """Bytes a device of `memory` bytes (as the box counts them) leaves for klein: less `RESERVED_GIB`."""
    return memory - RESERVED_GIB * GIB


def known(name: str) -> str | None:
    """The table's name for `name` (`find`), or None where it names no device."""
    wanted = _plain(name)
    plain = _plain_names()
    around = [p for p in plain if wanted and wanted in p and plain[p] not in ALIASES]
    if wanted in plain or len(around) == 1:
        found = plain[wanted if wanted in plain else around[0]]
        return ALIASES.get(found, found)
    return None


def find(name: str) -> str:
    """The table's name for `name`, read without case, spaces or punctuation ("RTX 4090", "rtx4090":
    "rtx-4090"), an old name (`ALIASES`), or the one name it is part of ("4090"); an `InputError` naming
    the nearest names otherwise."""
    found = known(name)
    if found is not None:
        return found
    wanted, plain = _plain(name), _plain_names()
    # Names around the one typed ("3060") or inside it ("rtx4090ti") first, then the most alike.
    around = [p for p in plain if wanted and (wanted in p or p in wanted)]
    inside = sorted(around, key=lambda p: -difflib.SequenceMatcher(None, p, wanted).ratio())
    alike = difflib.get_close_matches(wanted, list(plain), n=3, cutoff=0.6)
    close = list(dict.fromkeys(ALIASES.get(plain[p], plain[p]) for p in inside + alike))
    hint = (
        f"did you mean {' or '.join(close[:3])}?" if close else "klein plan --help lists the devices it knows"
    )
    raise InputError(f"unknown device {name!r:.40}; {hint}")


def renamed(name: str) -> str:
    """A note where `name` is an old name ("`h100` is now called `h100-80gb`"), else ""."""
    old = next((alias for alias in ALIASES if _plain(alias) == _plain(name)), None)
    return f"note: `{old}` is now called `{ALIASES[old]}`" if old else ""


def _plain_names() -> dict[str, str]:
    return {_plain(known): known for known in (*DEVICES, *ALIASES)}


def _plain(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def listing() -> str:
    """The devices for `--help`, a line per memory per device: "  8 GB: rtx-3060-ti (int8), ..."."""
    sizes: dict[int, list[str]] = {}
    for name, device in DEVICES.items():
        size = device.memory_gib // device.devices_per_chip
        sizes.setdefault(size, []).append(f"{name} ({device.compute})")
    return "\n".join(f"  {size:>3} GB: {', '.join(names)}" for size, names in sorted(sizes.items()))
