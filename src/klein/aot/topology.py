"""TPU slices and NVIDIA GPUs compiled from this machine: a target's devices, described without owning
them, and the device mesh `klein plan --target` lays over them. The one place that decides what a
`--target` name is (see docs/devices.md).
"""

from __future__ import annotations

import importlib.util
import math
import os

import numpy as np
from jax.sharding import AxisType, Mesh

from klein import devices as table
from klein import sharding
from klein.aot import gpu_targets
from klein.errors import InputError


def devices(target: str) -> list:
    """The devices of `target`: a TPU slice ("v6e:2x4") or NVIDIA cards ("h100-80gb", "h100-80gb:8")."""
    card, count = gpu(target)
    if card is not None:
        return _gpu_devices(target, card, count)
    libtpu_name = _libtpu_name(target)
    if not available():
        raise InputError(
            f"compiling for {target} needs libtpu, which this environment lacks: pip install klein[tpu]"
        )
    from jax.experimental import topologies

    # Off a TPU VM there is no metadata server to ask about the host: asking would only wait. And describing
    # a slice touches no TPU, so several processes may (libtpu otherwise locks itself to one process).
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        return list(topologies.get_topology_desc(topology_name=libtpu_name, platform="tpu").devices)
    except Exception as error:  # libtpu's own error type for a name it does not know
        raise InputError(
            f"--target {target!r}: libtpu knows no such slice ({str(error).splitlines()[0]}); e.g. "
            f"{', '.join(table.SLICES)}; or a card: {', '.join(table.TARGETS)}"
        ) from None


def mesh(target: str, spec: str | None) -> tuple[Mesh, str]:
    """(the mesh `spec` describes over the first devices of `target`, its spec with explicit sizes). No spec
    (`tensor`) or a lone axis name puts every device on that axis; "single" is one device."""
    slice_devices = devices(target)
    spec = (spec or "tensor").strip()
    if spec == "single":
        sizes = {"data": 1}
    elif spec in sharding.PRESETS and "=" not in spec:
        sizes = {spec: len(slice_devices)}
    else:
        sizes = sharding.parse(spec)
    count = math.prod(sizes.values())
    if count > len(slice_devices):
        raise InputError(f"mesh {spec!r} needs {count} devices; {target} has {len(slice_devices)}")
    grid = np.array(slice_devices[:count]).reshape(tuple(sizes.values()))
    explicit = ",".join(f"{name}={size}" for name, size in sizes.items())
    return Mesh(grid, tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes)), explicit


def available() -> bool:
    """Whether this environment can compile for TPU slices (libtpu is installed)."""
    return importlib.util.find_spec("libtpu") is not None


def gpu_available() -> bool:
    """Whether this environment can compile for NVIDIA GPUs (jax's CUDA plugin and cuDNN are installed)."""
    try:
        return all(importlib.util.find_spec(name) for name in ("jax_plugins.xla_cuda12", "nvidia.cudnn"))
    except ModuleNotFoundError:  # no `jax_plugins` or `nvidia` package at all
        return False


def gpu(target: str) -> tuple[table.Device | None, int]:
    """(the card `target` names, how many of it), or (None, 0) for a name that is not a GPU's."""
    typed, _, count = target.partition(":")
    name = table.known(typed)
    card = table.DEVICES.get(name) if name else None
    if card is None or not card.capability:
        return None, 0
    if card.gpu is None:
        raise InputError(
            f"--target {typed}: klein has no compiler description of {name}; it compiles for "
            f"{', '.join(table.TARGETS)} (plan {name} with --device {name})"
        )
    if count and not (count.isdigit() and int(count) > 0):
        raise InputError(f"--target {target!r}: expected {typed} or {typed}:COUNT (cards on one host)")
    return card, int(count or 1)


def _libtpu_name(target: str) -> str:
    """`target` as libtpu names it: a TPU chip's name in the table made libtpu's ("tpu-v6e:2x4" "v6e:2x4")."""
    typed, _, shape = target.partition(":")
    name = table.known(typed)
    chip = table.DEVICES[name] if name else None
    if chip is None or not chip.slice:
        return target
    if not shape:
        raise InputError(f"--target {typed}: name a slice of {name}, e.g. {chip.slice}")
    return f"{chip.slice.partition(':')[0]}:{shape}"


def _gpu_devices(target: str, card: table.Device, count: int) -> list:
    if not gpu_available():
        raise InputError(
            f"compiling for {target} needs jax's CUDA plugin and cuDNN, which this environment lacks: "
            "pip install klein[gpu-plan]"
        )
    # Without a GPU the plugin's check of the CUDA driver's version can only fail; it must be skipped
    # before jax first loads its plugins, or the plugin is not registered at all.
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    from jax.experimental import topologies

    try:
        description = topologies.get_topology_desc(
            target, "cuda", topology=f"1x1x{count}", target_config=gpu_targets.target_config(card)
        )
    except NotImplementedError:  # jax loaded its plugins before the check could be skipped
        raise InputError(
            f"--target {target}: jax's CUDA plugin did not load in this process (no GPU driver here); "
            "run with JAX_PLATFORMS=cpu"
        ) from None
    return list(description.devices)
