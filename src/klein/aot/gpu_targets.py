"""NVIDIA GPUs described to XLA without owning one: the `GpuTargetConfigProto` that jax's CUDA plugin
compiles for when it is given no device, for the cards `klein plan --target` names, from the device table
(`klein.devices`). What it leaves out (per-unit throughput tables) only tunes XLA's cost model.
"""

from __future__ import annotations

from klein.devices import Device

CUDNN = (9, 10, 0)
"""The cuDNN version the programs are compiled against (its fused attention's features depend on it)."""
CUDA_RUNTIME = (12, 9, 0)
"""The CUDA runtime the programs are compiled for (the `gpu-plan` extra's wheels are CUDA 12.9). Without
one XLA takes the runtime for 0.0, too old for cuBLASLt's FP8 products, and widens FP8 operands to f16
before every product it hands cuBLAS."""


def target_config(card: Device) -> str:
    """`card` (one with a `gpu` description) as the text of a `stream_executor.GpuTargetConfigProto`."""
    major, minor = card.capability.split(".")
    gpu = card.gpu
    info = {
        "threads_per_block_limit": 1024,
        "threads_per_warp": 32,
        "shared_memory_per_block": 49152,
        "shared_memory_per_core": gpu.shared_per_sm,
        "threads_per_core_limit": gpu.threads_per_sm,
        "core_count": gpu.sms,
        "fpus_per_core": 128,
        "block_dim_limit_x": 2**31 - 1,
        "block_dim_limit_y": 65535,
        "block_dim_limit_z": 65535,
        "memory_bandwidth": int(card.bandwidth),
        "l2_cache_size": gpu.l2_bytes,
        "clock_rate_ghz": gpu.clock_ghz,
        "device_memory_size": card.memory_bytes,
        "shared_memory_per_block_optin": gpu.shared_per_block_optin,
        "registers_per_core_limit": 65536,
        "registers_per_block_limit": 65536,
    }
    fields = "\n".join(f"  {name}: {value}" for name, value in info.items())
    version = "major: {} minor: {} patch: {}".format
    return (
        f"gpu_device_info {{\n{fields}\n  cuda_compute_capability {{ major: {major} minor: {minor} }}\n}}\n"
        'platform_name: "CUDA"\n'
        f"dnn_version_info {{ {version(*CUDNN)} }}\n"
        f"runtime_version {{ {version(*CUDA_RUNTIME)} }}\n"
        f'device_description_str: "{card.device_kind}"\n'
    )
