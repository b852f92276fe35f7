"""What an abstract model (built under `nnx.eval_shape`: shapes, no values) draws its initial weights
from: one fixed key for every draw, in place of `nnx.Rngs`.

`nnx.Rngs` counts its draws in a variable, and flax compares each new count's sharding with the old
one's; under a trace that asks jax for a tracer's sharding, whose error message walks the whole trace so
far. For the real VAE's ~130 layers that was 0.97 s of a process's start (0.14 s with these keys), paid by
every `klein` command that plans or loads. The shapes and the module graph are the same (tested); the
values are never computed.
"""

from __future__ import annotations

import jax


class AbstractKeys:
    """Stands in for `nnx.Rngs` while building a model under `nnx.eval_shape` only."""

    def __init__(self):
        self._key = jax.random.key(0)

    def params(self):
        return self._key

    def __call__(self):
        return self._key
