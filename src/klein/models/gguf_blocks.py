"""GGUF (ggml) quantisation blocks widened to float32 in JAX, one layer at a time inside the compiled
program (docs/design/checkpoints.md, "How a stored layer becomes a product").

Each function below takes blocks uint8[..., type_size] and returns their values float32[..., block_size]
with the same float32 operations in the same order as `gguf.quants.dequantize` (llama.cpp's definition),
so that the two agree to the bit. The layout of the arithmetic is chosen for XLA:CPU's loop over a
layer's values (docs/benchmarks/dequant-step-cpu.md): bytes read two at a time as little-endian 16-bit
words, and values from two shifts of a byte a select each, where a concatenation, or more than two shifts
along the last axis, becomes a branch per value that stops the loop from being vectorised.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

QK_K = 256  # values per K-quant super-block


def dequantise(raw, ggml_type: str):
    """float32[..., rows, columns] of `raw` uint8[..., rows, bytes] (each row whole blocks of `ggml_type`,
    named as `gguf.GGMLQuantizationType`). Any 8-bit array is read as its bytes: a stack slices its layers
    as float8 (`klein.models.stacks`)."""
    if raw.dtype != jnp.uint8:
        raw = jax.lax.bitcast_convert_type(raw, jnp.uint8)
    block_size, type_size, widen = _TYPES[ggml_type]
    *lead, width = raw.shape
    values = widen(raw.reshape(*lead, width // type_size, type_size))
    return values.reshape(*lead, width // type_size * block_size)


def sizes(ggml_type: str) -> tuple[int, int]:
    """(values, bytes) of one block of `ggml_type`."""
    return _TYPES[ggml_type][:2]


def _f16(b, at: int):
    """float32[..., 1] of the little-endian float16 at byte `at` (even) of blocks `b` uint8[..., size], read
    through the blocks' 16-bit words: XLA:CPU assembles a float16 from two bytes in a pass of its own,
    which slows the widening that reads it by half or more."""
    word = _words(b)[..., at // 2 : at // 2 + 1]
    return jax.lax.bitcast_convert_type(word, jnp.float16).astype(jnp.float32)


def _words(b):
    """`b` uint8[..., 2n] as n little-endian 16-bit words."""
    return jax.lax.bitcast_convert_type(b.reshape(*b.shape[:-1], b.shape[-1] // 2, 2), jnp.uint16)


def _in_words(words, shifts, width: int):
    """The values packed `width` bits apart in bytes read as 16-bit `words` [..., n]: [..., len(shifts), n,
    2], each word's low byte then its high one shifted right by each of `shifts` and masked, as `_shifted`
    of the bytes gives them, with half as many loads. Two shifts become a select per value; more become a
    branch per value, so those stay with `_shifted`, whose shift is the same along a row of n."""
    mask = jnp.uint16((1 << width) - 1)
    return jnp.stack([jnp.stack([(words >> s) & mask, (words >> (s + 8)) & mask], -1) for s in shifts], -3)


def _shifted(bytes_, shifts, width: int):
    """`bytes_` uint8[..., n] shifted right by each of `shifts` into [..., len(shifts), n], masked to `width`
    bits: the values packed `width` bits apart, one group of n per shift."""
    shifted = bytes_[..., None, :] >> jnp.asarray(shifts, jnp.uint8)[:, None]
    return shifted & jnp.uint8((1 << width) - 1)


def _nibbles(words):
    """Low nibbles of each byte, then high ones: [..., 4n] from the bytes' words uint16[..., n]."""
    return _in_words(words, (0, 4), 4).reshape(*words.shape[:-1], 4 * words.shape[-1])


def _q8_0(b):
    # Read as 17 little-endian 16-bit words (the scale, then 16 pairs of values), each pair's two int8
    # sign-extended by shifts: XLA:CPU gathers half as many loads as from 32 single bytes.
    words = jax.lax.bitcast_convert_type(b.reshape(*b.shape[:-1], 17, 2), jnp.int16)
    pairs = words[..., 1:]
    q = jnp.stack([(pairs << 8) >> 8, pairs >> 8], -1).reshape(*b.shape[:-1], 32)
    return q.astype(jnp.float32) * _f16(b, 0)


def _q4_0(b):
    q = (_nibbles(_words(b)[..., 1:]).astype(jnp.int8) - jnp.int8(8)).astype(jnp.float32)
    return _f16(b, 0) * q


def _q4_1(b):
    q = _nibbles(_words(b)[..., 2:]).astype(jnp.float32)
    return _f16(b, 0) * q + _f16(b, 2)


def _five_bit(qh, qs):
    """The 32 5-bit values of a Q5_0 / Q5_1 block: low nibbles from qs (as words), the fifth bits from qh
    (bit i of the little-endian uint32 for value i)."""
    high = (
        jax.lax.bitcast_convert_type(qh, jnp.uint32)[..., None] >> jnp.arange(32, dtype=jnp.uint32)
    ) & jnp.uint32(1)
    return _nibbles(qs) | (high.astype(jnp.uint16) << jnp.uint16(4))


def _q5_0(b):
    q = (_five_bit(b[..., 2:6], _words(b)[..., 3:]).astype(jnp.int8) - jnp.int8(16)).astype(jnp.float32)
    return _f16(b, 0) * q


def _q5_1(b):
    q = _five_bit(b[..., 4:8], _words(b)[..., 4:]).astype(jnp.float32)
    return _f16(b, 0) * q + _f16(b, 2)


def _q2_k(b):
    lead = b.shape[:-1]
    scales, qs = b[..., :16], b[..., 16:80]
    # From their bytes, not through `_f16`'s words: here XLA:CPU fuses those into a widening 1.5x slower.
    d, dmin = (jax.lax.bitcast_convert_type(b[..., at : at + 2], jnp.float16) for at in (80, 82))
    d, dmin = d.astype(jnp.float32)[..., None], dmin.astype(jnp.float32)[..., None]
    dl = (d * (scales & jnp.uint8(0xF)).astype(jnp.float32))[..., None]
    ml = (dmin * (scales >> jnp.uint8(4)).astype(jnp.float32))[..., None]
    q = _shifted(qs.reshape(*lead, 2, 32), (0, 2, 4, 6), 2).reshape(*lead, 16, 16).astype(jnp.float32)
    return (dl * q - ml).reshape(*lead, QK_K)


def _q3_k(b):
    lead = b.shape[:-1]
    hmask, qs, packed, d = b[..., :32], b[..., 32:96], b[..., 96:108], _f16(b, 108)
    low = _shifted(packed[..., :8], (0, 4), 4).reshape(*lead, 16)
    high = _shifted(packed[..., 8:], (0, 2, 4, 6), 2).reshape(*lead, 16)
    scales = ((low | (high << jnp.uint8(4))).astype(jnp.int8) - jnp.int8(32)).astype(jnp.float32)
    dl = (d * scales)[..., None]
    ql = _shifted(qs.reshape(*lead, 2, 32), (0, 2, 4, 6), 2).reshape(*lead, 16, 16)
    # A set bit of hmask means no offset; a clear one subtracts 4.
    qh = _shifted(hmask, tuple(range(8)), 1).reshape(*lead, 16, 16) ^ jnp.uint8(1)
    q = (ql.astype(jnp.int8) - (qh << jnp.uint8(2)).astype(jnp.int8)).astype(jnp.float32)
    return (dl * q).reshape(*lead, QK_K)


def _scale_min(packed):
    """The 8 6-bit scales and 8 6-bit minimums of a Q4_K / Q5_K super-block, from their 12 bytes."""
    lead = packed.shape[:-1]
    # Sub-block j reads byte j % 4 of each group of 4: a broadcast, not a concatenation, which XLA:CPU
    # turns into a branch per value.
    d, m, md = (
        jnp.broadcast_to(packed[..., None, i : i + 4], (*lead, 2, 4)).reshape(*lead, 8) for i in (0, 4, 8)
    )
    first, six = jnp.arange(8) < 4, jnp.uint8(0x3F)
    scale = jnp.where(first, d & six, (md & jnp.uint8(0xF)) | ((d >> jnp.uint8(2)) & jnp.uint8(0x30)))
    least = jnp.where(first, m & six, (md >> jnp.uint8(4)) | ((m >> jnp.uint8(2)) & jnp.uint8(0x30)))
    return scale.astype(jnp.float32), least.astype(jnp.float32)


def _k_scaled(b, q):
    """`d * scale * q - dmin * min` over the 8 sub-blocks of 32 of a Q4_K / Q5_K super-block."""
    scale, least = _scale_min(b[..., 4:16])
    d = (_f16(b, 0) * scale)[..., None]
    dm = (_f16(b, 2) * least)[..., None]
    return (d * q - dm).reshape(*b.shape[:-1], QK_K)


def _q4_k(b):
    lead = b.shape[:-1]
    q = _in_words(_words(b)[..., 8:].reshape(*lead, 4, 16), (0, 4), 4).reshape(*lead, 8, 32)
    return _k_scaled(b, q.astype(jnp.float32))


def _q5_k(b):
    lead = b.shape[:-1]
    ql = _in_words(_words(b)[..., 24:].reshape(*lead, 4, 16), (0, 4), 4).reshape(*lead, 8, 32)
    qh = _shifted(b[..., 16:48], tuple(range(8)), 1).reshape(*lead, 8, 32)
    return _k_scaled(b, (ql | (qh << jnp.uint8(4))).astype(jnp.float32))


def _q6_k(b):
    lead = b.shape[:-1]
    ql = _in_words(_words(b)[..., :64].reshape(*lead, 2, 32), (0, 4), 4).reshape(*lead, 8, 32)
    qh = _shifted(b[..., 128:192].reshape(*lead, 2, 32), (0, 2, 4, 6), 2).reshape(*lead, 8, 32)
    scales = jax.lax.bitcast_convert_type(b[..., 192:208], jnp.int8).astype(jnp.float32)
    d = (_f16(b, 208) * scales)[..., None]
    q = ((ql | (qh << jnp.uint8(4))).astype(jnp.int8) - jnp.int8(32)).reshape(*lead, 16, 16)
    return (d * q.astype(jnp.float32)).reshape(*lead, QK_K)


# ggml type name -> (values per block, bytes per block, the block's values)
_TYPES = {
    "Q8_0": (32, 34, _q8_0),
    "Q4_0": (32, 18, _q4_0),
    "Q4_1": (32, 20, _q4_1),
    "Q5_0": (32, 22, _q5_0),
    "Q5_1": (32, 24, _q5_1),
    "Q2_K": (QK_K, 84, _q2_k),
    "Q3_K": (QK_K, 110, _q3_k),
    "Q4_K": (QK_K, 144, _q4_k),
    "Q5_K": (QK_K, 176, _q5_k),
    "Q6_K": (QK_K, 210, _q6_k),
}
TYPES = tuple(_TYPES)
