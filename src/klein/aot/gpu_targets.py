"""NVIDIA GPUs described to XLA without owning one: the `GpuTargetConfigProto` that jax's CUDA plugin
compiles for when it is given no device (deviceless compilation), for the cards `klein plan --target`
names.

XLA's GPU compiler needs a device's description (compute capability, SM count, shared memory and
registers per SM, L2, memory size and bandwidth, clock) to pick its kernels; the PJRT plugin takes it as
the text proto of the topology option `target_config` and then needs neither a driver nor libcuda. The
figures are NVIDIA's published specifications (the H100 and H200 as in XLA's own target specs); what a
description leaves out (the per-unit throughput tables) only tunes XLA's cost model, not which kernels
exist.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Card:
    device_kind: str
    """The name a real card of it reports (`jax.Device.device_kind`)."""
    capability: tuple[int, int]
    sms: int
    clock_ghz: float
    """Boost clock."""
    memory_bytes: int
    """What the card reports to CUDA (a little under its name's GB or GiB)."""
    bandwidth: float
    """Bytes per second."""
    l2_bytes: int
    shared_per_sm: int
    shared_per_block_optin: int
    threads_per_sm: int


MIB = 2**20
CARDS = {
    "h100": Card(
        "NVIDIA H100 80GB HBM3", (9, 0), 132, 1.98, 84942979072, 3.35232e12, 50 * MIB, 233472, 232448, 2048
    ),
    "h200": Card("NVIDIA H200", (9, 0), 132, 1.98, 151397597184, 4.8e12, 50 * MIB, 233472, 232448, 2048),
    "l40s": Card("NVIDIA L40S", (8, 9), 142, 2.52, 46068 * MIB, 864e9, 96 * MIB, 102400, 101376, 1536),
    "rtx-4090": Card(
        "NVIDIA GeForce RTX 4090", (8, 9), 128, 2.52, 24564 * MIB, 1008e9, 72 * MIB, 102400, 101376, 1536
    ),
}
CUDNN = (9, 10, 0)
"""The cuDNN version the programs are compiled against (its fused attention's features depend on it)."""
CUDA_RUNTIME = (12, 9, 0)
"""The CUDA runtime the programs are compiled for (the `gpu-plan` extra's wheels are CUDA 12.9). Without
one XLA takes the runtime for 0.0, too old for cuBLASLt's FP8 products, and widens FP8 operands to f16
before every product it hands cuBLAS."""


def target_config(card: Card) -> str:
    """`card` as the text of a `stream_executor.GpuTargetConfigProto`."""
    major, minor = card.capability
    info = {
        "threads_per_block_limit": 1024,
        "threads_per_warp": 32,
        "shared_memory_per_block": 49152,
        "shared_memory_per_core": card.shared_per_sm,
        "threads_per_core_limit": card.threads_per_sm,
        "core_count": card.sms,
        "fpus_per_core": 128,
        "block_dim_limit_x": 2**31 - 1,
        "block_dim_limit_y": 65535,
        "block_dim_limit_z": 65535,
        "memory_bandwidth": int(card.bandwidth),
        "l2_cache_size": card.l2_bytes,
        "clock_rate_ghz": card.clock_ghz,
        "device_memory_size": card.memory_bytes,
        "shared_memory_per_block_optin": card.shared_per_block_optin,
        "registers_per_core_limit": 65536,
        "registers_per_block_limit": 65536,
    }
    fields = "\n".join(f"  {name}: {value}" for name, value in info.items())
    cudnn = dict(zip(("major", "minor", "patch"), CUDNN, strict=True))
    runtime = dict(zip(("major", "minor", "patch"), CUDA_RUNTIME, strict=True))
    return (
        f"gpu_device_info {{\n{fields}\n  cuda_compute_capability {{ major: {major} minor: {minor} }}\n}}\n"
        'platform_name: "CUDA"\n'
        f"dnn_version_info {{ {' '.join(f'{k}: {v}' for k, v in cudnn.items())} }}\n"
        f"runtime_version {{ {' '.join(f'{k}: {v}' for k, v in runtime.items())} }}\n"
        f'device_description_str: "{card.device_kind}"\n'
    )
