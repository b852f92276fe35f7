"""Attention on one TPU device: Pallas' splash attention kernel, with klein's masks as segment ids.

The same contract as the blocked XLA kernel of `klein.models.attention`, for the masks klein's models use
(none, key padding, causal): a key is given segment 1 where its rank hides it, every query segment 0.
Token counts are padded to whole blocks. Off a TPU (`interpret=True`) Pallas interprets the same kernel
with XLA, which is how CPU tests check its numerics. See docs/design/compiling.md, "TPU attention".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from einops import rearrange
from jax.experimental.pallas.ops.tpu import splash_attention as splash

BLOCK = 512
"""Queries and keys per tile (both): fewer grid steps than the kernel's default 128, well inside a TPU
core's VMEM at head dims up to 512 (the VAE's)."""
LANES = 128
"""A TPU vector register's lanes: token counts are padded to whole blocks of at least this."""
WIDE_KEYS, WIDE_FROM, WIDE_PADDING = 2048, 8192, 0.25
"""Keys a tile for long key sequences (`WIDE_FROM` keys or more, where padding them to whole tiles adds at
most `WIDE_PADDING` of keys), each tile's products still over `BLOCK` keys at a time. Measured on a v5e
(bf16, 24 heads of 128, `benchmarks/tpu/tpu_splash_blocks.py`): 155 TFLOP/s over 20,480 tokens against 117
with 512 keys a tile, 115 against 106 at 8,704 (padded to 10,240); at 4,608 tokens 512 stays the best. Those
were one call each, dispatch included; inside klein-4b's step splash over 4,608 tokens runs at 130 TFLOP/s
(`benchmarks/tpu/tpu_step_profile.py`), and the sweep now chains its calls in one program."""


def supports(q) -> bool:
    """Whether the kernel takes these queries: head dims in whole vector registers (128, 256, 512)."""
    return q.shape[-1] % LANES == 0


def attention(q, k, v, q_rank=None, k_rank=None, causal: bool = False, interpret: bool = False, blocks=None):
    """q float[B, Sq, H, Dh]; k, v float[B, Sk, K, Dh]; ranks int32[B or 1, S] or None -> float[B, Sq, H, Dh].
    `blocks`: (queries, keys, keys per product) a tile, or None for `BLOCK` each (fewer where the tokens are)."""
    b, sq, _, dh = q.shape
    sk = k.shape[1]
    block_q, block_kv, block_compute = blocks or (_block(sq), _key_block(sk), _block(sk))
    sq_pad, sk_pad = _round_up(sq, block_q), _round_up(sk, block_kv)
    q_seg, kv_seg = _segments(q_rank, k_rank, sq, sk, causal)
    kv_seg = jnp.pad(kv_seg, ((0, 0), (0, sk_pad - sk)), constant_values=1)
    q_seg = jnp.pad(q_seg, ((0, 0), (0, sq_pad - sq)))
    tile = splash.BlockSizes(block_q=block_q, block_kv=block_kv, block_kv_compute=block_compute)
    kernel = _kernel(sq_pad, sk_pad, q.shape[2], tile, causal, interpret)
    # Splash does not scale the scores; heads lead and the head dim is minor inside it.
    q = rearrange(_pad(q * jnp.asarray(dh**-0.5, q.dtype), sq_pad), "b s h d -> b h s d")
    k, v = (rearrange(_pad(x, sk_pad), "b s h d -> b h s d") for x in (k, v))
    segments = splash.SegmentIds(jnp.broadcast_to(q_seg, (b, sq_pad)), jnp.broadcast_to(kv_seg, (b, sk_pad)))
    out = rearrange(jax.vmap(kernel)(q, k, v, segments), "b h s d -> b s h d")[:, :sq]
    return jnp.where(_sees_a_key(q_rank, k_rank)[..., None, None], out, 0).astype(q.dtype)


def _segments(q_rank, k_rank, sq: int, sk: int, causal: bool):
    """Segment ids int32[B or 1, Sq], int32[B or 1, Sk]: queries 0, keys 1 where their rank hides them."""
    q_seg = jnp.zeros((1, sq), jnp.int32)
    if k_rank is None:
        return q_seg, jnp.zeros((1, sk), jnp.int32)
    # Causal: ranks are positions (the static mask compares those), so only a key off its position hides.
    # Otherwise every query ranks the same, the first one's.
    hidden = k_rank != jnp.arange(sk, dtype=k_rank.dtype) if causal else k_rank > q_rank[:, :1]
    return q_seg, hidden.astype(jnp.int32)


def _sees_a_key(q_rank, k_rank):
    """bool[B or 1, Sq]: the query ranks at least one key's rank (else klein's contract gives zeros)."""
    if k_rank is None:
        return jnp.ones((1, 1), bool)
    return k_rank.min(axis=1, keepdims=True) <= q_rank


def _kernel(sq: int, sk: int, heads: int, tile, causal: bool, interpret: bool):
    """The forward-only kernel for one image's [H, Sq, Dh] queries over [K, Sk, Dh] keys (K divides H)."""
    one = splash.CausalMask((sq, sk)) if causal else splash.FullMask((sq, sk))
    return splash.make_splash_mha_single_device(
        splash.MultiHeadMask([one] * heads), block_sizes=tile, interpret=interpret
    )


def _block(tokens: int) -> int:
    return min(BLOCK, _round_up(tokens, LANES))


def _key_block(tokens: int) -> int:
    wide = tokens >= WIDE_FROM and _round_up(tokens, WIDE_KEYS) <= tokens * (1 + WIDE_PADDING)
    return WIDE_KEYS if wide else _block(tokens)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _pad(x, size: int):
    """Pad the token axis (1) of x with zeros to `size`."""
    return jnp.pad(x, [(0, 0), (0, size - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
