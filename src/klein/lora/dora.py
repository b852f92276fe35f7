"""DoRA per request: the statistics of an update D against the weight W it adapts, one number per output
row each (||W_o||^2, <W_o, D_o>, ||D_o||^2), from which the program forms DoRA's gain at any strength s,
m / sqrt(||W_o||^2 + 2 s <W_o, D_o> + s^2 ||D_o||^2) (`klein.models.adapters`), without D ever formed
(docs/design/lora.md, "LoRA per request").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_HIGHEST = jax.lax.Precision.HIGHEST


def row_statistics(weight, down: np.ndarray, up: np.ndarray, kron: tuple) -> tuple[np.ndarray, ...]:
    """(||W_o||^2, <W_o, D_o>, ||D_o||^2) float32[O] of W float32[O, I] (on the device) and the update D:
    the Kronecker product of the one pair (w1, w2) in `kron`, else `(down @ up)^T` (down float32[I, r], up
    float32[r, O])."""
    if kron:
        ((w1, w2),) = kron
        cross, square = _kron_statistics(weight, w1, w2)
    else:
        cross, square = _low_rank_statistics(weight, down, up)
    return np.asarray(_row_norms(weight)), np.asarray(cross), np.asarray(square)


@jax.jit
def _row_norms(weight):
    """||W_o||^2 float32[O] of W float32[O, I]."""
    return jnp.sum(weight * weight, axis=1)


@jax.jit
def _low_rank_statistics(weight, down, up):
    """(<W_o, D_o>, ||D_o||^2) float32[O] of W float32[O, I] and D = (down @ up)^T."""
    cross = jnp.sum(up.T * jnp.matmul(weight, down, precision=_HIGHEST), axis=1)
    gram = jnp.matmul(down.T, down, precision=_HIGHEST)
    square = jnp.sum(up.T * jnp.matmul(up.T, gram, precision=_HIGHEST), axis=1)
    return cross, square


@jax.jit
def _kron_statistics(weight, w1, w2):
    """(<W_o, D_o>, ||D_o||^2) float32[O] of W float32[O, I] and D = kron(w1, w2), without forming D."""
    (a, b), (c, d) = w1.shape, w2.shape
    grid = weight.reshape(a, c, b, d)
    cross = jnp.einsum("piqj,pq,ij->pi", grid, w1, w2, precision=_HIGHEST).reshape(-1)
    square = jnp.outer(jnp.sum(w1 * w1, axis=1), jnp.sum(w2 * w2, axis=1)).reshape(-1)
    return cross, square
