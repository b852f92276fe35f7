"""The blocked attention equals jax.nn.dot_product_attention with the dense mask its ranks stand for:
several query and key blocks, padded last blocks, fewer queries than a block, cross-attention, grouped
queries, bf16, causal + padding ranks (rows with no key give zeros), KV editing's isolated span."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from klein.models import attention as A
from klein.models.attention import MASKED, QUERY_BLOCK, attention, isolated_span_attention
from tests.support.compare import max_abs
from tests.support.platforms import cpu_only

pytestmark = cpu_only(
    "float32 bounds of 1e-5 for products a TPU makes in bf16 passes by default (on a v5e 9 of these failed); "
    "tests/tpu/test_tpu_attention.py compares on the chip under `highest` precision"
)


def qkv(n_q, n_k, heads=3, kv_heads=3, dtype=jnp.float32, seed=0, batch=2):
    rng = np.random.default_rng(seed)
    shapes = ((batch, n_q, heads, 16), (batch, n_k, kv_heads, 16), (batch, n_k, kv_heads, 16))
    return (jnp.asarray(rng.standard_normal(s) * 2, dtype) for s in shapes)


def reference(q, k, v, mask=None):
    """XLA's dense attention; rows that may attend to nothing give zeros."""
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    out = jax.nn.dot_product_attention(q, k, v, mask=mask)
    if mask is None:
        return out
    return out * jnp.any(mask, axis=-1).transpose(0, 2, 1)[..., None]


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 32 queries x 64 keys: many tiles on small inputs."""
    monkeypatch.setattr(A, "QUERY_BLOCK", 32)
    monkeypatch.setattr(A, "KEY_BLOCK", 64)


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
    q, k, v = qkv(n_q, n_k, dtype=dtype)
    want = reference(q, k, v)
    got = jax.jit(attention)(q, k, v)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)


@pytest.mark.parametrize("n_q,n_k,kv_heads", [(100, 300, 3), (70, 129, 1), (64, 64, 3)])
def test_online_softmax_over_key_blocks(small_blocks, n_q, n_k, kv_heads):
    q, k, v = qkv(n_q, n_k, heads=3, kv_heads=kv_heads)
    got = jax.jit(attention)(q, k, v)
    np.testing.assert_allclose(got, reference(q, k, v), atol=1e-5, rtol=1e-5)


def test_causal_and_padding_ranks(small_blocks):
    length, heads, kv_heads = 150, 4, 2
    q, k, v = qkv(length, length, heads, kv_heads)
    valid = np.ones((2, length), bool)
    valid[0, :40] = False  # left padding, as the text encoder's tokenizer pads
    valid[1, 130:] = False
    positions = np.arange(length)
    q_rank = jnp.asarray(np.broadcast_to(positions, (2, length)), jnp.int32)
    k_rank = jnp.asarray(np.where(valid, positions, MASKED), jnp.int32)
    mask = jnp.asarray(np.tril(np.ones((length, length), bool))[None, None] & valid[:, None, None, :])
    got = jax.jit(attention)(q, k, v, q_rank, k_rank)
    np.testing.assert_allclose(got, reference(q, k, v, mask), atol=1e-5, rtol=1e-5)
    assert float(jnp.abs(got[0, :40]).max()) == 0.0  # rows with no key to see
    # Sensitive: without the padding ranks the padded keys would be seen.
    unpadded = attention(q, k, v, q_rank, q_rank)
    assert max_abs(unpadded, got) > 1e-2


@pytest.mark.parametrize("padded_keys", [0, 7])
def test_isolated_span(small_blocks, padded_keys):
    n, start, stop = 140, 30, 95
    q, k, v = qkv(n, n)
    k_rank = None
    mask = np.ones((n, n), bool)
    inside = (np.arange(n) >= start) & (np.arange(n) < stop)
    mask[inside] = inside  # span queries see only span keys
    if padded_keys:
        keep = np.arange(n) < n - padded_keys
        k_rank = jnp.asarray(np.where(keep, 0, MASKED)[None], jnp.int32)
        mask &= keep[None]
    got = jax.jit(isolated_span_attention, static_argnums=(3, 4))(q, k, v, start, stop, k_rank)
    want = reference(q, k, v, jnp.asarray(mask)[None, None])
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    assert max_abs(got, reference(q, k, v)) > 1e-2  # the span changes the result
