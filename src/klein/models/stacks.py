"""Stacks of layers: weights (and reference keys / values) with a leading layer axis L, run one layer at a
time inside `jax.lax.scan`, so that compile time does not grow with depth.

A stack narrower than 32 bits is kept as its bit pattern (`as_bits`: bfloat16 as uint16, float8 as uint8)
and each layer viewed as floats again once sliced (`layer`): XLA:CPU cannot slice bfloat16 or float8
without widening the whole stack. A stack may live in host memory (residency `stream`): `layer` moves
each layer to the device as the loop reaches it. See docs/design/memory.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from klein.models import gguf_blocks
from klein.models.abstract_keys import AbstractKeys

# Float type -> the unsigned integer of its width; and back.
_BITS = {
    np.dtype(ml_dtypes.bfloat16): np.dtype(np.uint16),
    np.dtype(ml_dtypes.float8_e4m3fn): np.dtype(np.uint8),
}
_FLOATS = {bits: floating for floating, bits in _BITS.items()}


def stack(make, count: int, rngs: nnx.Rngs | AbstractKeys):
    """`count` modules `make(rngs)`, each drawn from its own split of `rngs`, stacked on a leading axis
    (with `AbstractKeys`, for shapes alone, every one from the same key)."""
    if isinstance(rngs, AbstractKeys):
        return nnx.vmap(lambda _: make(rngs), in_axes=0, out_axes=0)(jnp.arange(count))

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=0, out_axes=0)
    def build(rngs):
        return make(rngs)

    return build(rngs)


def as_bits(array):
    """`array` (NumPy or JAX) in its stored form: the bit pattern of a bf16 / float8 array, else itself."""
    return view(array, _BITS.get(np.dtype(array.dtype), array.dtype))


def as_float(array):
    """The float array whose stored form (`as_bits`) `array` is; any other array as it is."""
    return view(array, _FLOATS.get(np.dtype(array.dtype), array.dtype))


def view(array, dtype):
    """`array` (NumPy or JAX) viewed as `dtype` of the same width, without a copy."""
    if array.dtype == dtype:
        return array
    if isinstance(array, np.ndarray):
        return array.view(dtype)
    return jax.lax.bitcast_convert_type(array, dtype)


def layer(stack, index):
    """Layer `index` (static or traced) of every array of the pytree `stack`, as floats, on the device."""

    def one(a):
        sliced = jax.lax.dynamic_index_in_dim(a, index, keepdims=False)
        if jax.typeof(a).memory_space == jax.memory.Space.Host:
            sliced = jax.device_put(sliced, jax.memory.Space.Device)
        return as_float(sliced)

    return jax.tree.map(one, stack)


def empty(count: int, shape: tuple[int, ...], dtype):
    """A stack of `count` layers of zeros of `shape` and `dtype`, in its stored form (`as_bits`), for
    `put` to fill."""
    return jnp.zeros((count, *shape), _BITS.get(np.dtype(dtype), dtype))


def put(stack, index, value):
    """`stack` (in its stored form) with layer `index` (static or traced) set to `value`."""
    return jax.lax.dynamic_update_index_in_dim(stack, as_bits(value), index, 0)


def rows(table, ids, blocks: str | None = None, dtype=None):
    """`table[ids]` in the table's own dtype, gathered from its stored form (bits, as a layer is sliced): the
    text encoder's token lookup, whose rows set the dtype every later layer computes in. A table of GGUF
    quantisation blocks (`blocks`: its ggml type) gives its rows widened to `dtype`: only the rows gathered
    are, never the table."""
    gathered = jnp.take(as_bits(table), ids, axis=0)
    if blocks is None:
        return as_float(gathered)
    return gguf_blocks.dequantise(gathered, blocks).astype(dtype)


def scan(body, carry, stacks, count: int, start: int = 0):
    """`body(carry, layers) -> (carry, ys)` over layers start..count-1 of `stacks` (a pytree of stacks),
    each layer sliced from the whole stacks inside the loop: running a part of a stack copies nothing.
    Returns (carry, ys stacked on a new leading axis).

    The range may be empty (a model with one single block runs none before its last one; a step cache's
    groups split a stack in three): the carry comes back as it is and every ys has no rows; the body is
    traced on one layer's shapes only, since a stack of no layers has nothing to slice."""
    if count <= start:
        one = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape[1:], _FLOATS.get(np.dtype(a.dtype), a.dtype)), stacks
        )
        _, ys = jax.eval_shape(body, carry, one)
        return carry, jax.tree.map(lambda y: jnp.zeros((0, *y.shape), y.dtype), ys)

    def step(carry, index):
        return body(carry, layer(stacks, index))

    return jax.lax.scan(step, carry, jnp.arange(start, count))
