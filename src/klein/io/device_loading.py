"""Reading a checkpoint onto an accelerator (TPU, GPU) at the speed of the reads: the host only reads.

On a CPU (`klein.io.loading.load_module`'s own path) each Linear weight is transposed from PyTorch's layout
to NNX's, and quantised for int8 products, in NumPy: on a TPU host those passes, not the reads, took most of
a load (a bf16 transpose in NumPy runs at well under 1 GB/s). Here each large weight is read as it is stored,
by threads that read `READ_AHEAD` tensors ahead into host buffers used again (`klein.io.read_buffers`: new
arrays' pages cost more than the reads on a sandboxed TPU host), each thread sending what it read to the
device as it is, to be transposed there (and quantised there for int8) into its place in its stack, the
stack updated in place.
The small programs that do it (a few per shape of weight: tens of them, a tenth of a second or more each to
compile) are compiled by the reading threads as each shape first comes, beside the reads and transfers.

The weights are bit for bit those of the host path: a transpose moves bits, a cast to the same dtype is
none, and the int8 quantisation is `klein.models.products.quantise`'s float32 operations in its order, the
reciprocal of each scale taken on the host in NumPy as `products.in_8_bits` takes it (a device's division
need not round as NumPy's does), the scales themselves a maximum and a product, exact everywhere.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from klein.errors import CheckpointError
from klein.io import read_buffers
from klein.io.mapped import MappedSource
from klein.io.quantised import ChannelScales, Quantised
from klein.models import products
from klein.models.stacks import as_bits

READ_AHEAD = 6
"""Tensors (or layers of a stack) read ahead of the one being sent: host memory of a few layers."""
MIN_BYTES = 8 * 2**20
"""A weight (a layer of a stack) smaller than this is prepared on the host as on a CPU: a transpose of a few
megabytes costs less there than compiling one more small program on the device."""


def wanted(place) -> bool:
    """Whether to read onto the device this way: the default placement (one device, no mesh, nothing in
    host memory) on an accelerator. A mesh or host placement keeps the host path."""
    return place is None and jax.devices()[0].platform != "cpu"


class Job:
    """One parameter to fill: its checkpoint keys (one per layer of a stack), its abstract value, the dtype
    its values are read as, the PyTorch-layout shape each key must have and the transpose to NNX's."""

    def __init__(self, path, keys, layers, abstract, target_dtype, want, axes):
        self.path, self.keys, self.layers, self.abstract = path, keys, layers, abstract
        self.target_dtype, self.want, self.axes = target_dtype, want, axes


def fill(jobs: list[Job], source, host_read: Callable[[Job, object], np.ndarray]) -> list[jax.Array]:
    """The device array of every job, in order: large Linear weights transposed (and int8-quantised) on the
    device, every other parameter by `host_read(job, source)` (the CPU path's reading) and sent as it is.
    Reads run `READ_AHEAD` ahead of the transfers, in threads."""
    stash: dict[str, np.ndarray] = {}  # scales of weights quantised on the device, by their scale key
    scaled = _ScalesFrom(source, stash)
    programs = _Programs()
    # Buffers used again where the device's memory is its own (a transfer copies); a CPU reads as before:
    # its device_put aliases an aligned NumPy array, may_alias=False or not (jax 0.10.2), and the next read
    # into the buffer would change the weights sent.
    buffers = read_buffers.Pool() if jax.devices()[0].platform != "cpu" else None
    tasks = []  # (job index, layer index or None, read: () -> host array or sent one, prefetch?)
    for index, job in enumerate(jobs):
        if _on_device(job, source):
            for layer, key in enumerate(job.keys):
                read = functools.partial(_sent, source, job, key, programs, buffers)
                tasks.append((index, layer, read, True))
        else:  # the scales of weights quantised on the device are stashed then: read when their turn comes
            later = any(isinstance(_piece(source, key), ChannelScales) for key in job.keys)
            tasks.append((index, None, functools.partial(host_read, job, scaled), not later))
    results: list = [None] * len(jobs)
    for (index, layer, _, _), host in zip(tasks, _read_ahead(tasks), strict=True):
        job = jobs[index]
        if layer is None:
            results[index] = jax.device_put(as_bits(host) if job.layers else host)
            continue
        value = _prepared(source, job, job.keys[layer], host, stash, programs)
        if not job.layers:
            results[index] = value
        elif layer == 0:
            results[index] = programs.stack(value, len(job.keys))
        else:
            results[index] = programs.into(results[index], value, layer)
    return results


def _on_device(job: Job, source) -> bool:
    """Whether `job` is a Linear weight worth transposing (or quantising) on the device."""
    quantised = [_int8(source, key) for key in job.keys]
    if len(job.want) != 2 or any(quantised) != all(quantised) or (job.axes is None and not quantised[0]):
        return False
    size = int(np.prod(job.want)) * (2 if quantised[0] else np.dtype(job.target_dtype).itemsize)
    return size >= MIN_BYTES


def _piece(source, key):
    return source.piece(key) if isinstance(source, MappedSource) else None


def check_shape(source, key: str, want: tuple) -> None:
    """A CheckpointError unless tensor `key` of `source` has the PyTorch-layout shape `want`."""
    shape = source.shape(key)
    if want != shape:
        raise CheckpointError(
            f"{source.file_of(key)}: tensor '{key}' has shape {shape}, "
            f"the model expects {want}; wrong model variant or config?"
        )


def _int8(source, key) -> bool:
    """Whether `source` reads `key` quantised per channel for int8 (`klein.io.quantised.Quantised`)."""
    piece = _piece(source, key)
    return type(piece) is Quantised and piece.compute == products.INT8


def _sent(source, job: Job, key: str, programs: _Programs, buffers: read_buffers.Pool | None) -> jax.Array:
    """Tensor `key` as stored (PyTorch layout; a weight to quantise in its float form), in the dtype it is
    kept in (as bits where it is a stack's layer), its shape checked as the host path checks it, read into
    a buffer of `buffers` and sent to the device, the transfer waited for (the buffer is read again next);
    the programs that prepare it compiled."""
    check_shape(source, key, job.want)
    piece = _piece(source, key)
    int8 = _int8(source, key)
    with buffers.taken() if buffers is not None else contextlib.nullcontext():
        if int8:
            host = np.asarray(piece.piece.read(source.inner))
        else:
            host = source.get(key).astype(job.target_dtype, copy=False)
        programs.compile(job, host, int8)
        # In the device's own memory, the transfer complete before the buffer is read into again.
        sent = jax.device_put(host if int8 or not job.layers else as_bits(host))
        return sent.block_until_ready()


def _prepared(source, job: Job, key: str, sent: jax.Array, stash: dict, programs) -> jax.Array:
    """Layer `key` of `job` (`sent` as stored) on the device in NNX's layout (as bits where it is a
    stack's): transposed, quantised first for int8 (its scales left in `stash`)."""
    if not _int8(source, key):
        return programs.transposed(sent, job.axes)
    scales = np.asarray(programs.scales(sent))  # float32[out, 1]: exact on any device
    stash[key.removesuffix(".weight") + ".weight_scale"] = scales[:, 0]
    reciprocal = np.float32(1) / scales  # NumPy's division, as `products.in_8_bits` divides
    return programs.quantised(sent, reciprocal, job.axes)


class _Programs:
    """The device programs of one load, each compiled once (by whichever thread first needs it; the others
    wait for it) and called as compiled."""

    def __init__(self):
        self._lock = threading.Lock()
        self._compiled: dict[tuple, Future] = {}

    def compile(self, job: Job, host: np.ndarray, int8: bool) -> None:
        """Compile every program that prepares a layer like `host` of `job` (read as stored)."""
        spec = jax.ShapeDtypeStruct
        if int8:
            weight = spec(host.shape, host.dtype)
            self._get(_scales, weight)
            out = self._get(_quantised, weight, spec((host.shape[0], 1), np.float32), axes=job.axes)
        else:
            stored = as_bits(host[:0]) if job.layers else host[:0]
            out = self._get(_transposed, spec(host.shape, stored.dtype), axes=job.axes)
        if job.layers:
            layer = out.out_info
            stack = self._get(_stack, layer, count=len(job.keys)).out_info
            self._get(_into, stack, layer, spec((), np.int32))

    def transposed(self, array, axes):
        return self._get(_transposed, array, axes=axes)(array)

    def scales(self, weight):
        return self._get(_scales, weight)(weight)

    def quantised(self, weight, reciprocal, axes):
        return self._get(_quantised, weight, reciprocal, axes=axes)(weight, reciprocal)

    def stack(self, first, count):
        return self._get(_stack, first, count=count)(first)

    def into(self, stack, value, index):
        index = np.int32(index)
        return self._get(_into, stack, value, index)(stack, value, index)

    def _get(self, function, *args, **static):
        """`function` compiled for arguments shaped as `args` (arrays or `jax.ShapeDtypeStruct`s) and the
        `static` ones."""
        shapes = tuple((tuple(a.shape), np.dtype(a.dtype)) for a in args)
        key = (function, shapes, tuple(sorted(static.items())))
        with self._lock:
            future = self._compiled.get(key)
            mine = future is None
            if mine:
                future = self._compiled[key] = Future()
        if mine:
            try:
                specs = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
                future.set_result(function.lower(*specs, **static).compile())
            except BaseException as exc:
                future.set_exception(exc)
                raise
        return future.result()


def _read_ahead(tasks: list) -> Iterator[np.ndarray]:
    """Each task's host array, in order: those marked to prefetch read by threads up to `READ_AHEAD`
    ahead, the others read when their turn comes."""
    with ThreadPoolExecutor(max_workers=READ_AHEAD) as pool:
        pending: collections.deque = collections.deque()
        ahead = 0  # the next task not yet submitted
        for i, (_, _, read, _) in enumerate(tasks):
            while ahead < len(tasks) and ahead < i + READ_AHEAD:
                later = tasks[ahead]
                pending.append(pool.submit(later[2]) if later[3] else None)
                ahead += 1
            future = pending.popleft()
            yield future.result() if future is not None else read()


class _ScalesFrom:
    """`source`, whose int8 scales of weights quantised on the device come from `stash` (each read once);
    every other key as `source` gives it."""

    def __init__(self, source, stash: dict):
        self._source, self._stash = source, stash

    def __getattr__(self, name):
        return getattr(self._source, name)

    def get(self, key: str) -> np.ndarray:
        if key in self._stash:
            return self._stash.pop(key)
        return self._source.get(key)


@functools.partial(jax.jit, static_argnames="axes")
def _transposed(array, axes):
    return jnp.transpose(array, axes)


@jax.jit
def _scales(weight):
    return products.scales_of(weight, products.INT8, 1)


@functools.partial(jax.jit, static_argnames="axes")
def _quantised(weight, reciprocal, axes):
    """`products.in_8_bits` of `weight` with the reciprocal of its scales, transposed by `axes` if any
    (8-bit weights are kept [out, in], as stored)."""
    operand, top, _ = products.EIGHT_BIT[products.INT8]
    scaled = jnp.clip(weight.astype(jnp.float32) * reciprocal, -top, top)
    quantised = jnp.round(scaled).astype(operand)
    return quantised if axes is None else jnp.transpose(quantised, axes)


@functools.partial(jax.jit, static_argnames="count")
def _stack(first, count):
    """A stack of `count` layers, `first` its layer 0 (the others zeros until set)."""
    return jnp.zeros((count, *first.shape), first.dtype).at[0].set(first)


@functools.partial(jax.jit, donate_argnums=0)
def _into(stack, value, index):
    """`stack` with layer `index` set to `value`, in place (the stack is donated)."""
    return jax.lax.dynamic_update_index_in_dim(stack, value, index, 0)
