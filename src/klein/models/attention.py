"""The one attention function every model block calls: the seam for kernels (XLA, cuDNN, splash).

Shapes: q float[B, Sq, H, Dh]; k, v float[B, Sk, H, Dh]; mask bool broadcastable to [B, H, Sq, Sk]
(True = may attend); returns float[B, Sq, H, Dh].
"""

import jax
import jax.numpy as jnp


def attention(q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray, mask: jnp.ndarray | None = None) -> jnp.ndarray:
    return jax.nn.dot_product_attention(q, k, v, mask=mask)
