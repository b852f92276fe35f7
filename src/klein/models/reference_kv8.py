"""Reference keys and values in 8 bits (`kv_dtype="int8"`): each layer's keys (and values) of the references
stored as int8 with one float32 scale per head (its largest magnitude over the real tokens and the head's
dimensions, over 127), quantised inside the prefill as each layer records them, so that the keys and
values of every layer never exist in bf16 at once, and widened back one layer at a time in the cached
step, where they are spliced into that layer's keys and values. Half the bytes of bf16 keys and values:
four 1024^2 references on klein-9b-kv take 4 GiB instead of 8.

The prefill of 8-bit keys and values also runs its blocks in pieces of `PREFILL_PIECE` reference tokens
(`klein.models.blocks.in_pieces`): every token's keys and values are computed whole, the queries, the
MLP and the output projection a piece at a time, so that the fused projection of all the references
(the prefill's widest tensor) never exists at once. See docs/design/memory.md, "8-bit reference KV".
"""

from __future__ import annotations

import jax.numpy as jnp

from klein.models import stacks
from klein.models.facts import KV_INT8

INT8 = KV_INT8
"""`kv_dtype` of 8-bit keys and values (`klein.models.facts.KV_INT8`)."""
PREFILL_PIECE = 4096
"""Reference tokens a piece of an 8-bit prefill runs its queries and MLP over (a 1024^2 reference)."""
_LEVELS = 127.0


def quantise(x, real=None):
    """x float[R, H, Dh] -> (int8[R, H, Dh], float32[H]): per head, its largest magnitude over the tokens
    `real` (bool[R], None: all; padding is clipped, and masked where it is read) maps to 127."""
    magnitude = jnp.abs(x.astype(jnp.float32))
    if real is not None:
        magnitude = jnp.where(real[:, None, None], magnitude, 0.0)
    scale = jnp.max(magnitude, axis=(0, 2)) / _LEVELS
    scale = jnp.where(scale > 0, scale, 1.0)
    values = jnp.clip(jnp.round(x.astype(jnp.float32) / scale[:, None]), -_LEVELS, _LEVELS)
    return values.astype(jnp.int8), scale


def dequantise(values, scale, dtype):
    """int8[..., R, H, Dh] and their scales float32[..., H] -> float[..., R, H, Dh] of `dtype`."""
    return (values.astype(jnp.float32) * scale[..., None, :, None]).astype(dtype)


def record(x, real, quantised: bool):
    """One layer's keys (or values) float[R, H, Dh] in the form a prefill stacks them: their bits, or
    (int8, scales) where `quantised`."""
    return quantise(x, real) if quantised else stacks.as_bits(x)


def empty(count: int, shape: tuple[int, int, int], dtype, quantised: bool):
    """A stack of `count` layers of keys (or values) of `shape` [R, H, Dh] for `put` to fill."""
    if not quantised:
        return stacks.empty(count, shape, dtype)
    return jnp.zeros((count, *shape), jnp.int8), jnp.zeros((count, shape[1]), jnp.float32)


def put(stack, index, x, real, quantised: bool):
    """`stack` (`empty`'s) with layer `index` set to x float[R, H, Dh]."""
    if not quantised:
        return stacks.put(stack, index, x)
    values, scale = quantise(x, real)
    return stacks.put(stack[0], index, values), stacks.put(stack[1], index, scale)


def floats(layer_kv, dtype):
    """One layer's cached (k, v) as the attention splices them, float[R, H, Dh] of `dtype`: as they are,
    or widened from ((int8, scales), (int8, scales)); None stays None."""
    if layer_kv is None or not isinstance(layer_kv[0], tuple):
        return layer_kv
    return tuple(dequantise(values, scale, dtype) for values, scale in layer_kv)
