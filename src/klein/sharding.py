"""Sharding as data: logical axis names, one rules table per preset, and the mesh they map onto.

Each preset is a mesh axis of the same name plus the logical axes it shards (`PRESETS`); a logical axis
no preset of the mesh names is replicated. The same tables place each weight as the loader reads it,
resolve the activation constraints inside the model and drive the memory planner (on an abstract mesh).
See docs/design/compiling.md, "Sharding".
"""

from __future__ import annotations

import contextlib
import math
import re

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from klein.errors import InputError, counted

# Preset (= mesh axis name) -> the logical axes it shards. "single" is the empty mesh.
PRESETS: dict[str, tuple[str, ...]] = {
    "single": (),
    "data": ("batch",),
    "fsdp": ("embed",),
    "tensor": ("heads", "kv_heads", "mlp", "fused"),
    "context": ("seq", "ref_seq"),
}

# Dotted parameter path (stacked layers included) -> logical axes of its dimensions. Modulation,
# the final adaLN and the embedders shard only their width under fsdp: tensor parallelism leaves them
# whole, as it does every norm weight (those match no rule).
TRANSFORMER_PARAMS: tuple[tuple[str, tuple], ...] = (
    (r"transformer_blocks\.attn\.(to_[qkv]|add_[qkv]_proj)\.kernel", ("layers", "embed", "heads")),
    (r"transformer_blocks\.attn\.(to_out|to_add_out)\.kernel", ("layers", "heads", "embed")),
    (r"transformer_blocks\.ff(_context)?\.linear_in\.kernel", ("layers", "embed", "mlp")),
    (r"transformer_blocks\.ff(_context)?\.linear_out\.kernel", ("layers", "mlp", "embed")),
    (r"single_transformer_blocks\.attn\.to_qkv_mlp_proj\.kernel", ("layers", "embed", "fused")),
    (r"single_transformer_blocks\.attn\.to_out\.kernel", ("layers", "fused", "embed")),
    (
        r"(double_stream_modulation_(img|txt)|single_stream_modulation|norm_out)\.linear\.kernel",
        ("embed", None),
    ),
    (r"time_guidance_embed\.timestep_embedder\.linear_1\.kernel", (None, "embed")),
    (r"time_guidance_embed\.timestep_embedder\.linear_2\.kernel", ("embed", None)),
    (r"(x_embedder|context_embedder)\.kernel", (None, "embed")),
    (r"proj_out\.kernel", ("embed", None)),
)
TEXT_ENCODER_PARAMS: tuple[tuple[str, tuple], ...] = (
    (r"model\.embed_tokens\.embedding", ("vocab", "embed")),
    (r"model\.layers\.self_attn\.q_proj\.kernel", ("layers", "embed", "heads")),
    (r"model\.layers\.self_attn\.[kv]_proj\.kernel", ("layers", "embed", "kv_heads")),
    (r"model\.layers\.self_attn\.o_proj\.kernel", ("layers", "heads", "embed")),
    (r"model\.layers\.mlp\.(gate|up)_proj\.kernel", ("layers", "embed", "mlp")),
    (r"model\.layers\.mlp\.down_proj\.kernel", ("layers", "mlp", "embed")),
)

# Activations: the token streams of the transformer, and the reference KV cache.
TOKENS = ("batch", "seq", None)
REFERENCE_KV = ("layers", "ref_seq", "heads", None)


def parse(spec: str) -> dict[str, int]:
    """Axis sizes of a mesh spec, {"fsdp": 4, "context": 2} for "fsdp=4,context=2"; a lone preset name
    ("tensor") puts every device on that axis, "single" is no mesh."""
    spec = spec.strip()
    if spec in PRESETS and "=" not in spec:
        return {} if spec == "single" else {spec: jax.device_count()}
    sizes = {}
    for part in spec.split(","):
        name, _, size = (s.strip() for s in part.partition("="))
        if name not in PRESETS or name == "single":
            raise InputError(f"mesh {spec!r}: unknown axis {name!r}; axes are data, fsdp, tensor, context")
        if name in sizes or not size.isdigit() or int(size) < 1:
            raise InputError(f"mesh {spec!r}: write each axis once as name=size, e.g. fsdp=4,context=2")
        sizes[name] = int(size)
    return sizes


def make_mesh(spec: str | None) -> Mesh | None:
    """The device mesh for `spec` over every device of every process; None for a single device."""
    sizes = parse(spec) if spec is not None else {}
    if not sizes:
        return None
    count = jax.device_count()
    if math.prod(sizes.values()) != count:
        raise InputError(
            f"mesh {spec!r} needs {counted(math.prod(sizes.values()), 'device')}, but "
            f"{counted(count, 'is', 'are')} available ({counted(jax.process_count(), 'process', 'processes')}); "
            "the axis sizes must multiply to the device count"
        )
    # Auto axes: the compiler partitions from the constraints (GSPMD), rather than sharding-in-types.
    return jax.make_mesh(tuple(sizes.values()), tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes))


def abstract_mesh(spec: str) -> AbstractMesh:
    """The mesh shape alone, for planning without the devices ("single": one device)."""
    if spec.strip() in PRESETS and spec.strip() != "single":
        raise InputError(f"mesh {spec!r}: give its size for planning, e.g. {spec.strip()}=8")
    sizes = parse(spec) or {"data": 1}
    return AbstractMesh(tuple(sizes.values()), tuple(sizes))


def describe(mesh: Mesh | AbstractMesh | None) -> str:
    return ",".join(f"{name}={size}" for name, size in mesh.shape.items()) if mesh is not None else "single"


def mesh_axis(logical: str | None, mesh) -> str | None:
    """The mesh axis that shards `logical` on `mesh`, or None (replicated)."""
    for preset, names in PRESETS.items():
        if logical in names and preset in mesh.axis_names:
            return preset
    return None


def ways(mesh, logical: str) -> int:
    """How many shards `mesh` splits a `logical` dimension into (1 on an empty mesh)."""
    axis = mesh_axis(logical, mesh)
    return mesh.shape[axis] if axis else 1


def context_ways() -> int:
    """Devices the token streams split over in the mesh of JAX's context (1 without one)."""
    return ways(jax.sharding.get_abstract_mesh(), "seq")


def covering(first: int, count: int, total: int) -> tuple[int, int]:
    """Rows [start, stop) of a sequence of `total` holding rows [first, first + count), as many as a
    multiple of the context size (`context_ways`: context parallelism splits them evenly) where the
    sequence allows: the rows a layer computes when only some of its outputs are read."""
    multiple = context_ways()
    size = min(-(-count // multiple) * multiple, total)
    start = min(first, total - size)
    return start, start + size


def partition_spec(axes: tuple, mesh, shape: tuple | None = None) -> PartitionSpec:
    """PartitionSpec of logical `axes` (trailing dimensions left out are replicated); with `shape`,
    dimensions a mesh axis does not divide stay whole."""
    spec = [mesh_axis(logical, mesh) for logical in axes]
    if shape is not None:
        spec = [
            a if a is None or size % mesh.shape[a] == 0 else None
            for a, size in zip(spec, shape[: len(spec)], strict=True)
        ]
    # Canonical form without trailing Nones: jit's cache tells P("a", None) from P("a") apart.
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def param_axes(path: tuple, table) -> tuple:
    """Logical axes of the parameter at `path` (a tuple of names); unmatched parameters are replicated.
    A Linear's `weight` (its kernel stored [out, in] for 8-bit products, `klein.models.layers.Linear`)
    has its kernel's axes with the last two swapped: the split axis moves with the out axis."""
    if path and path[-1] == "weight":
        axes = param_axes((*path[:-1], "kernel"), table)
        return (*axes[:-2], axes[-1], axes[-2]) if len(axes) >= 2 else axes
    dotted = ".".join(str(p) for p in path)
    for pattern, axes in table:
        if re.fullmatch(pattern, dotted):
            return axes
    return ()


def placer(mesh: Mesh | None, table=(), host: tuple[str, ...] = ()):
    """The loader's `place(path, host_array)`: each weight goes straight to its own shards; those under
    the dotted path prefixes `host` to host memory (`pinned_host`: the residency policy `stream`)."""
    if mesh is None and not host:
        return None

    def place(path, array: np.ndarray) -> jax.Array:
        dotted = ".".join(str(p) for p in path)
        in_host = any(dotted == prefix or dotted.startswith(prefix + ".") for prefix in host)
        if mesh is None:
            host_memory = SingleDeviceSharding(jax.local_devices()[0], memory_kind="pinned_host")
            return jax.device_put(array, host_memory) if in_host else jax.device_put(array)
        # A dimension the mesh does not divide stays whole: the bytes of a row of quantisation blocks.
        target = NamedSharding(mesh, partition_spec(param_axes(path, table), mesh, array.shape))
        # device_put sends each device only its slice; in multi-process runs every process holds the
        # same host array and transfers just its own devices' slices.
        return jax.device_put(array, target.with_memory_kind("pinned_host") if in_host else target)

    return place


def put(x, axes: tuple, mesh: Mesh | None):
    """Place an input on the mesh (unchanged without one); a dimension its axis does not divide stays
    whole."""
    if mesh is None:
        return x
    return jax.device_put(x, NamedSharding(mesh, partition_spec(axes, mesh, x.shape)))


def constrain(x: jax.Array, axes: tuple) -> jax.Array:
    """Ask the compiler to lay `x` out along logical `axes` on the mesh in context; a no-op without one.

    These are layout hints: a dimension a mesh axis does not divide (the single image of a reference
    prefill under data parallelism) stays whole rather than padded.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, partition_spec(axes, mesh, x.shape))


def local_devices(mesh: Mesh | None) -> list:
    """The devices of this process that a program on `mesh` runs on (None: jax's first device)."""
    return mesh.local_devices if mesh is not None else jax.local_devices()[:1]


def platform() -> str:
    """The platform of the program being traced: the devices of the mesh in JAX's context (a TPU slice
    compiled from this machine is a TPU program), else the default backend."""
    device = jax.sharding.get_abstract_mesh().abstract_device  # None without a mesh of devices
    return jax.default_backend() if device is None else device.platform


def use(mesh: Mesh | None):
    """Context in which jitted code traces against `mesh` (JAX keys its compilation cache on it)."""
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


def check_divisible(mesh, what: str, dims: list[tuple[str, str, int]]) -> None:
    """Raise InputError unless each (logical axis, label, size) divides evenly over its mesh axis."""
    if mesh is None:
        return
    for logical, label, size in dims:
        axis = mesh_axis(logical, mesh)
        if axis is not None and size % mesh.shape[axis] != 0:
            raise InputError(
                f"mesh {describe(mesh)} does not fit {what}: {label} = {size} is not divisible by "
                f"{axis} = {mesh.shape[axis]}"
            )


def transformer_dims(cfg) -> list[tuple[str, str, int]]:
    """(logical axis, label, size) of the dimensions the rules split in a `TransformerConfig`."""
    return [
        ("heads", "attention heads", cfg.num_attention_heads),
        ("mlp", "MLP width", cfg.mlp_hidden),
        ("embed", "model width", cfg.hidden),
    ]


def text_encoder_dims(cfg) -> list[tuple[str, str, int]]:
    """(logical axis, label, size) of the dimensions the rules split in a `Qwen3Config`."""
    return [
        ("heads", "attention heads", cfg.num_attention_heads),
        ("kv_heads", "key/value heads", cfg.num_key_value_heads),
        ("mlp", "MLP width", cfg.intermediate_size),
        ("embed", "hidden size", cfg.hidden_size),
    ]


def start_processes(coordinator: str | None, num_processes: int | None, process_id: int | None) -> None:
    """Join a multi-process run (one process per host, or several on one machine over loopback).

    Call before anything touches a device. None lets JAX read them from the cluster (SLURM, TPU pods,
    Kubernetes). CPU devices talk over gloo; GPUs and TPUs use their own collectives.
    """
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
