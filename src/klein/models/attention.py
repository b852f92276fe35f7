"""The one attention function every model block calls: the seam for kernels (XLA, cuDNN, splash).

Shapes: q float[B, Sq, H, Dh]; k, v float[B, Sk, H, Dh]; mask bool broadcastable to [B, H, Sq, Sk]
(True = may attend); returns float[B, Sq, H, Dh].

On one device, without a mask, queries go through in blocks of `QUERY_BLOCK` with heads-major operands.
XLA would otherwise materialise every Sq x Sk score at once and contract over token-major operands:
measured on two CPU cores at 5.6k tokens, 2.5x slower than these blocks (and 56 GB of scores at 9b,
1024^2, four references). Scores and softmax are float32 whatever the input dtype, as in `jax.nn`.

On a device mesh, the queries stay split along their tokens while keys and values are all-gathered
(context parallelism): every device computes complete softmax rows for its own queries, so split keys
need no correction. Under tensor parallelism each device holds whole heads. The query blocks are not
used there: splitting the token axis into blocks would fight its split over devices.
"""

import jax
import jax.numpy as jnp

from klein.sharding import constrain

QUERY_BLOCK = 256
_QUERIES = ("batch", "seq", "heads", None)
_GATHERED = ("batch", None, "heads", None)


def attention(q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray, mask: jnp.ndarray | None = None) -> jnp.ndarray:
    if mask is None and jax.sharding.get_abstract_mesh().empty:
        return _blocked(q, k, v)
    q = constrain(q, _QUERIES)
    k, v = constrain(k, _GATHERED), constrain(v, _GATHERED)
    return constrain(jax.nn.dot_product_attention(q, k, v, mask=mask), _QUERIES)


def _blocked(q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray) -> jnp.ndarray:
    b, sq, h, dh = q.shape
    block = min(QUERY_BLOCK, sq)
    count = -(-sq // block)
    # Padded query rows attend like any other and are dropped at the end.
    q = jnp.pad(q * jnp.asarray(dh**-0.5, q.dtype), ((0, 0), (0, count * block - sq), (0, 0), (0, 0)))
    blocks = q.reshape(b, count, block, h, dh).transpose(1, 0, 3, 2, 4)  # [count, B, H, block, Dh]
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, H, Sk, Dh]

    def one(q_block):
        scores = jnp.einsum("bhqd,bhkd->bhqk", q_block, k, preferred_element_type=jnp.float32)
        weights = jnp.exp(scores - scores.max(-1, keepdims=True))
        out = jnp.einsum("bhqk,bhkd->bhqd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return (out / weights.sum(-1, keepdims=True)).astype(q_block.dtype)

    out = jax.lax.map(one, blocks)
    return out.transpose(1, 0, 3, 2, 4).reshape(b, count * block, h, dh)[:, :sq]
