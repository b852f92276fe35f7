"""The blocked attention equals jax.nn.dot_product_attention: several blocks, a padded last block,
fewer queries than a block, cross-attention (more keys than queries), bf16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from klein.models.attention import QUERY_BLOCK, attention


@pytest.mark.parametrize(
    "n_q,n_k,dtype,tol",
    [
        (2 * QUERY_BLOCK + 37, 2 * QUERY_BLOCK + 37, jnp.float32, 1e-5),
        (QUERY_BLOCK + 1, 3 * QUERY_BLOCK, jnp.float32, 1e-5),
        (20, 50, jnp.float32, 1e-5),
        (QUERY_BLOCK + 5, QUERY_BLOCK + 5, jnp.bfloat16, 3e-2),
    ],
)
def test_matches_jax_reference(n_q, n_k, dtype, tol):
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, n, 3, 16)) * 2, dtype) for n in (n_q, n_k, n_k))
    want = jax.nn.dot_product_attention(q, k, v)
    got = jax.jit(attention)(q, k, v)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)


def test_mask_is_honoured():
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 6, 2, 8)), jnp.float32) for _ in range(3))
    mask = jnp.tril(jnp.ones((6, 6), bool))[None, None]
    np.testing.assert_allclose(
        attention(q, k, v, mask), jax.nn.dot_product_attention(q, k, v, mask=mask), atol=1e-6
    )
