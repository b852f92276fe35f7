"""TPU slices compiled from this machine: a slice's devices, described by libtpu without owning a TPU, and
the device mesh `klein plan --target` lays over them.

`jax.experimental.topologies.get_topology_desc` gives the devices of a named slice ("v6e:2x4"); programs
lowered with shardings on a mesh of them compile for that slice (nothing runs, nothing is allocated), which
is how `klein.pipeline.compiled` measures a TPU program's memory on a CPU host. libtpu comes with the
`tpu` extra (`pip install klein[tpu]`); without it this refuses with that instruction.
"""

from __future__ import annotations

import importlib.util
import math
import os

import numpy as np
from jax.sharding import AxisType, Mesh

from klein import sharding
from klein.errors import InputError

TARGETS = ("tpu7x:2x2x1", "v6e:2x4", "v5e:2x4", "v5p:2x2x1")
"""Slices `klein plan --target` is tested with; any name libtpu knows works."""


def devices(target: str) -> list:
    """The devices of the TPU slice `target` (e.g. "v6e:2x4"), as libtpu describes them."""
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
        return list(topologies.get_topology_desc(topology_name=target, platform="tpu").devices)
    except Exception as error:  # libtpu's own error type for a name it does not know
        raise InputError(
            f"--target {target!r}: libtpu knows no such slice ({str(error).splitlines()[0]}); e.g. "
            f"{', '.join(TARGETS)}"
        ) from None


def mesh(target: str, spec: str | None) -> tuple[Mesh, str]:
    """(the mesh `spec` describes over the first devices of `target`, its spec with explicit sizes). No spec,
    or a lone axis name, puts every device of the slice on one axis (`tensor` by default: the weights split,
    and every stage with them); "single" is one device."""
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
