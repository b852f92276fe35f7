"""The one attention function every model block calls: the seam for kernels (XLA, cuDNN, splash).

Shapes: q float[B, Sq, H, Dh]; k, v float[B, Sk, H, Dh]; mask bool broadcastable to [B, H, Sq, Sk]
(True = may attend); returns float[B, Sq, H, Dh].

Under context parallelism the queries stay split along their tokens while keys and values are
all-gathered: every device computes complete softmax rows for its own queries, so split keys need no
correction. Under tensor parallelism each device holds whole heads.
"""

import jax
import jax.numpy as jnp

from klein.sharding import constrain

_QUERIES = ("batch", "seq", "heads", None)
_GATHERED = ("batch", None, "heads", None)


def attention(q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray, mask: jnp.ndarray | None = None) -> jnp.ndarray:
    q = constrain(q, _QUERIES)
    k, v = constrain(k, _GATHERED), constrain(v, _GATHERED)
    return constrain(jax.nn.dot_product_attention(q, k, v, mask=mask), _QUERIES)
