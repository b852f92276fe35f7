"""Strict loading of PyTorch-layout checkpoints into Flax NNX modules.

A module's own parameter paths name the checkpoint keys (`("attn", "to_q", "kernel")` is `attn.to_q.weight`);
the differences are declared, not coded per layer: `stacked` prefixes (scanned layers, layer `i` of
`blocks.x.kernel` is `blocks.{i}.x.weight`), a `key_map` for the few renames left, a `skip` predicate. Every
other key must be used exactly once and every parameter found, else a CheckpointError names the keys.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from klein.errors import CheckpointError, counted
from klein.io import device_loading
from klein.io.safetensors import TensorSource
from klein.models.stacks import as_bits

# NNX leaf names -> PyTorch parameter names.
_LEAF_NAMES = {"kernel": "weight", "scale": "weight", "embedding": "weight"}
# A kernel's axes, PyTorch layout -> NNX layout: Linear (out, in) -> (in, out), Conv OIHW -> HWIO.
_KERNEL_AXES = {2: (1, 0), 4: (2, 3, 1, 0)}
_MAX_LISTED = 20


def torch_key(path: tuple, stacked: Iterable[str] = (), key_map: Callable[[str], str] | None = None):
    """Checkpoint key(s) of one parameter path: a string, or a format string with `{}` for the layer."""
    parts = [str(p) for p in path]
    parts[-1] = _LEAF_NAMES.get(parts[-1], parts[-1])
    dotted = ".".join(parts)
    for prefix in stacked:
        if dotted.startswith(prefix + "."):
            dotted = prefix + ".{}." + dotted[len(prefix) + 1 :]
            break
    return key_map(dotted) if key_map else dotted


def load_module(
    abstract: nnx.Module,
    source: TensorSource,
    *,
    dtype=jnp.float32,
    stacked: Iterable[str] = (),
    key_map: Callable[[str], str] | None = None,
    skip: Callable[[str], bool] = lambda key: False,
    place: Callable[[tuple, np.ndarray], jax.Array] | None = None,
    on_device: bool | None = None,
) -> nnx.Module:
    """Fill an abstract module (from `nnx.eval_shape`) with the tensors of `source`, floating-point ones cast
    to `dtype` (None: the abstract module's own). `place(path, host_array)` puts one parameter on its
    device(s); the default, `jax.device_put`, takes the (aligned) host array as it is on CPU.

    on_device: large Linear weights sent as stored and transposed (int8 ones quantised) on the device, the
    reads ahead of the transfers in threads (`klein.io.device_loading`: the same bits, read in a fraction of
    the time on a TPU); None (the default): so where the default placement is an accelerator's."""
    stacked = tuple(stacked)
    graphdef, state = nnx.split(abstract)
    flat = list(nnx.to_flat_state(state))
    plan = {path: _keys(path, variable, stacked, key_map) for path, variable in flat}
    _check_keys(plan, source, skip)
    if device_loading.wanted(place) if on_device is None else on_device:
        jobs = [_job(path, *plan[path], variable.get_value(), dtype) for path, variable in flat]
        arrays = device_loading.fill(jobs, source, _host_read)
        loaded = [
            (path, variable.replace(array)) for (path, variable), array in zip(flat, arrays, strict=True)
        ]
        return nnx.merge(graphdef, nnx.from_flat_state(loaded))
    place = place or (lambda path, array: jax.device_put(array))
    loaded = []
    for path, variable in flat:
        keys, layers = plan[path]
        host = _read(source, path, keys, layers, variable.get_value(), dtype)
        loaded.append((path, variable.replace(place(path, as_bits(host) if layers else host))))
    return nnx.merge(graphdef, nnx.from_flat_state(loaded))


def stored_state(abstract: nnx.Module, dtype, stacked: Iterable[str] = ()) -> tuple[nnx.GraphDef, nnx.State]:
    """(graph, weights as `jax.ShapeDtypeStruct`s) of `abstract` as `load_module` would store it with
    `dtype`, stacks as their bits: for compiling the real programs without weights."""
    stacked = tuple(stacked)
    graphdef, state = nnx.split(abstract)
    flat = []
    for path, variable in nnx.to_flat_state(state):
        value = variable.get_value()
        kind = value.dtype
        if dtype is not None and isinstance(variable, nnx.Param) and jnp.issubdtype(kind, jnp.floating):
            kind = dtype
        if _keys(path, variable, stacked, None)[1]:
            kind = as_bits(np.empty(0, kind)).dtype
        flat.append((path, variable.replace(jax.ShapeDtypeStruct(value.shape, kind))))
    return graphdef, nnx.from_flat_state(flat)


def expected_shapes(abstract: nnx.Module, stacked: Iterable[str] = (), key_map=None) -> dict[str, tuple]:
    """The checkpoint keys and PyTorch-layout shapes a module expects (to check against real configs)."""
    stacked = tuple(stacked)
    out = {}
    for path, variable in nnx.to_flat_state(nnx.state(abstract)):
        keys, layers = _keys(path, variable, stacked, key_map)
        shape = variable.get_value().shape[1:] if layers else variable.get_value().shape
        out.update(dict.fromkeys(keys, _torch_shape(path, shape)))
    return out


def checkpoint_keys(
    abstract: nnx.Module, stacked: Iterable[str] = (), key_map=None
) -> dict[tuple, list[str]]:
    """The checkpoint key(s) of every parameter path: one per layer for stacked parameters."""
    flat = nnx.to_flat_state(nnx.state(abstract))
    return {path: _keys(path, variable, tuple(stacked), key_map)[0] for path, variable in flat}


def _keys(path: tuple, variable, stacked: tuple, key_map) -> tuple[list[str], bool]:
    """The checkpoint key(s) of parameter `path` (one per layer of a stack), and whether it is a stack."""
    key = torch_key(path, stacked, key_map)
    if "{}" not in key:
        return [key], False
    return [key.format(i) for i in range(variable.get_value().shape[0])], True


def _check_keys(plan, source: TensorSource, skip) -> None:
    wanted = {key for keys, _ in plan.values() for key in keys}
    have = source.keys()
    missing = sorted(wanted - have)
    unexpected = sorted(key for key in have - wanted if not skip(key))
    if not missing and not unexpected:
        return
    files = sorted({str(source.file_of(k)) for k in have}) or ["(no files)"]
    lines = [f"checkpoint {', '.join(files[:3])}{' ...' if len(files) > 3 else ''} does not match the model:"]
    if missing:
        lines.append(f"  {counted(len(missing), 'missing key')}: {_listing(missing)}")
    if unexpected:
        lines.append(f"  {counted(len(unexpected), 'unexpected key')}: {_listing(unexpected)}")
    lines.append("  Is this the right checkpoint for this model variant?")
    raise CheckpointError("\n".join(lines))


def _listing(keys: list[str]) -> str:
    more = f" ... and {len(keys) - _MAX_LISTED} more" if len(keys) > _MAX_LISTED else ""
    return ", ".join(keys[:_MAX_LISTED]) + more


def _job(path, keys, layers, abstract, dtype) -> device_loading.Job:
    want = _torch_shape(path, abstract.shape[1:] if layers else abstract.shape)
    target = _target_dtype(abstract, dtype)
    return device_loading.Job(path, keys, layers, abstract, target, want, _kernel_axes(path, len(want)))


def _host_read(job: device_loading.Job, source) -> np.ndarray:
    return _read(source, job.path, job.keys, job.layers, job.abstract, job.target_dtype)


def _target_dtype(abstract, dtype) -> np.dtype:
    floating = jnp.issubdtype(abstract.dtype, jnp.floating)
    return np.dtype(dtype) if floating and dtype is not None else abstract.dtype


def _read(source, path, keys, layers, abstract, dtype) -> np.ndarray:
    target_dtype = _target_dtype(abstract, dtype)
    out = _aligned_empty(abstract.shape, target_dtype)
    want = _torch_shape(path, abstract.shape[1:] if layers else abstract.shape)
    axes = _kernel_axes(path, len(want))
    for i, key in enumerate(keys):
        device_loading.check_shape(source, key, want)
        value = source.get(key)
        value = (value if axes is None else value.transpose(axes)).astype(target_dtype, copy=False)
        if layers:
            out[i] = value
        else:
            out[...] = value
    return out


def _aligned_empty(shape: tuple, dtype, alignment: int = 64) -> np.ndarray:
    """`np.empty` whose data starts on an `alignment`-byte boundary: XLA:CPU then uses the buffer in place
    (`jax.device_put` copies a less aligned one, holding the weight twice while it does)."""
    dtype = np.dtype(dtype)
    size = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(size + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start : start + size].view(dtype).reshape(shape)


def _kernel_axes(path: tuple, ndim: int) -> tuple[int, ...] | None:
    """The transpose from PyTorch's layout to NNX's of parameter `path`, if it has one."""
    return _KERNEL_AXES.get(ndim) if path[-1] == "kernel" else None


def _torch_shape(path: tuple, shape: tuple) -> tuple:
    axes = _kernel_axes(path, len(shape))
    return tuple(shape) if axes is None else tuple(shape[axis] for axis in np.argsort(axes))
