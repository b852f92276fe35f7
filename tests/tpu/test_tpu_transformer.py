"""On a TPU chip, at klein-4b's width and heads (reduced depth): KV editing's cached steps (`prefill`, then
`forward_cached`, whose attention reads the cached reference keys) give the velocity of the same KV
semantics in one pass (`forward_kv_uncached`, the references an isolated span), both through splash
attention; float32 under `highest` precision."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from klein.models import transformer as T
from klein.models.rope import rope_tables
from klein.sampling import image_ids, reference_ids, text_ids
from tests.support.compare import assert_close, rel_err
from tests.tpu.cases import GEOMETRY

pytestmark = pytest.mark.tpu

TOL = 1e-4
"""Relative: two float32 programs that differ in summation order (the CPU's test allows 1e-5 at tiny sizes)."""


def _rope(ids):
    return tuple(jnp.asarray(t) for t in rope_tables(ids, GEOMETRY.axes_dims_rope, GEOMETRY.rope_theta))


def test_cached_steps_equal_the_uncached_pass():
    model, rng = T.Flux2Transformer(GEOMETRY, rngs=nnx.Rngs(0)), np.random.default_rng(0)
    grids = [(16, 16), (8, 12)]  # two references: 352 tokens
    img = jnp.asarray(rng.standard_normal((2, 256, 128)), jnp.float32)
    ref = jnp.asarray(rng.standard_normal((352, 128)), jnp.float32)
    txt = jnp.asarray(rng.standard_normal((2, 77, GEOMETRY.joint_attention_dim)), jnp.float32)
    t = jnp.asarray([0.9, 0.4], jnp.float32)
    img_rope, ref_rope, txt_rope = _rope(image_ids(16, 16)), _rope(reference_ids(grids)), _rope(text_ids(77))
    graphdef, state = nnx.split(model)

    @jax.jit
    def velocities(state):
        """(cached, uncached, without the references)."""
        model = nnx.merge(graphdef, state)
        kv = T.prefill(model, ref, ref_rope)
        return (
            T.forward_cached(model, img, txt, t, img_rope, txt_rope, kv),
            T.forward_kv_uncached(model, img, txt, t, img_rope, txt_rope, ref, ref_rope),
            T.forward(model, img, txt, t, img_rope, txt_rope),
        )

    with jax.default_matmul_precision("highest"):
        cached, uncached, plain = velocities(state)
    print(f"cached against uncached: relative error {rel_err(cached, uncached):.2e}")
    assert_close(cached, uncached, TOL)
    assert rel_err(plain, uncached) > 1e-2  # the references matter: the check can fail
