"""A single block's queries, keys and values turned heads first in one pass, q and k normed and rotated on
the way: a Pallas kernel for a TPU's programs.

A single block's fused projection is token-major, [B, S, 3D + 2M]: its q, k and v columns are (head,
channel) pairs, and a TPU's attention takes each heads first, [B, H, S, Dh]. XLA made that layout with a
split and two copies a tensor beside the norm's and RoPE's own passes (klein-4b's 1024^2 step on a v5e:
about 10 ms of its 224 read back from the profiler, `benchmarks/tpu/tpu_step_profile.py`). Here each head's
(tokens, Dh) block is read where it lies in the projection, a block of whole 128-lane columns, and written
where it goes: one read and one write a tensor. q and k are normed and rotated in float32 as
`layers.RMSNorm` and `rope.apply_rope` do (their pairs swapped by the same signed permutation product,
exact: one nonzero of magnitude 1 an output, over values already in the projection's dtype).

Off a TPU (`interpret=True`) Pallas interprets the same kernel with XLA, which is how CPU tests check it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from klein.models.rope import swap_matrix

BLOCKS = (512, 256, 128, 64, 32, 16, 8)
"""Tokens a block, the first that divides the sequence (a TPU's tiles are 8 rows by 128 lanes)."""


def block(tokens: int) -> int | None:
    return next((b for b in BLOCKS if tokens % b == 0), None)


def supports(proj: jnp.ndarray, head_dim: int) -> bool:
    """Whether the kernel takes this projection: bf16, heads of whole 128-lane columns, tokens in blocks."""
    return proj.dtype == jnp.bfloat16 and head_dim % 128 == 0 and block(proj.shape[1]) is not None


def heads_first(proj, width: int, head_dim: int, q_scale, k_scale, eps: float, rope: tuple, interpret=False):
    """(q, k, v) bf16[B, H, S, Dh] of a single block's fused projection `proj` bf16[B, S, >= 3 * width]
    (q, k, v the first 3 * `width` columns, H = width / head_dim): q and k RMS-normed by `q_scale` /
    `k_scale` [Dh] and rotated by `rope` (cos, sin) float32[S, Dh]."""
    batch, tokens, _ = proj.shape
    heads, rows = width // head_dim, block(tokens)
    swap = jnp.asarray(swap_matrix(head_dim), proj.dtype)
    scales = jnp.stack([q_scale, k_scale]).astype(jnp.float32)

    def kernel(q_ref, k_ref, v_ref, cos_ref, sin_ref, scale_ref, swap_ref, q_out, k_out, v_out):
        cos, sin = cos_ref[...], sin_ref[...]
        for i, (x_ref, out) in enumerate(((q_ref, q_out), (k_ref, k_out))):
            x32 = x_ref[...].astype(jnp.float32)
            normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
            normed = (normed * scale_ref[i : i + 1, :]).astype(proj.dtype)
            swapped = jnp.dot(normed, swap_ref[...], preferred_element_type=jnp.float32)
            out[...] = (normed.astype(jnp.float32) * cos + swapped * sin).astype(out.dtype)
        v_out[...] = v_ref[...]

    def column(part):
        return pl.BlockSpec((pl.Squeezed(), rows, head_dim), lambda b, s, h: (b, s, part * heads + h))

    # Heads innermost: a block of the tables is fetched once for all heads.
    table = pl.BlockSpec((rows, head_dim), lambda b, s, h: (s, 0))
    whole = pl.BlockSpec((2, head_dim), lambda b, s, h: (0, 0))
    square = pl.BlockSpec((head_dim, head_dim), lambda b, s, h: (0, 0))
    out = pl.BlockSpec((pl.Squeezed(), pl.Squeezed(), rows, head_dim), lambda b, s, h: (b, h, s, 0))
    shape = jax.ShapeDtypeStruct((batch, heads, tokens, head_dim), proj.dtype)
    return pl.pallas_call(
        kernel,
        grid=(batch, tokens // rows, heads),
        in_specs=[column(0), column(1), column(2), table, table, whole, square],
        out_specs=[out, out, out],
        out_shape=[shape, shape, shape],
        interpret=interpret,
    )(proj, proj, proj, *(t.astype(jnp.float32) for t in rope), scales, swap)
