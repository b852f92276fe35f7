"""RoPE's rotation (`klein.models.rope.apply_rope`) against the interleaved pairs' rotation written out."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from klein.models import blocks, rope
from klein.models.layers import RMSNorm
from klein.models.rope import apply_rope, rope_tables


def reference(x, table):
    """The reference's rotation: channels as (real, imaginary) pairs on a last axis of 2."""
    cos, sin = (t[None, :, None, :] for t in table)
    x32 = x.astype(jnp.float32)
    pairs = x32.reshape(*x.shape[:-1], -1, 2)
    rotated = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)
    return (x32 * cos + rotated * sin).astype(x.dtype)


def inputs(dtype, dim=128, tokens=37, heads=3):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 64, (tokens, 4))
    axes = (dim // 4,) * 4
    table = tuple(jnp.asarray(t) for t in rope_tables(ids, axes, 2000.0))
    x = jnp.asarray(rng.standard_normal((2, tokens, heads, dim)) * 3.0, dtype)
    return x, table


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_apply_rope_is_the_interleaved_rotation_exactly(dtype):
    """Op by op (each result rounded as written) the same bits; compiled, XLA:CPU may contract either
    product of `x * cos + swapped * sin` into a fused multiply-add, so the sum can round once instead of
    twice: at most one unit in the last place of `dtype` apart."""
    x, table = inputs(dtype)
    got, want = apply_rope(x, table), reference(x, table)
    assert got.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    got, want = (np.asarray(jax.jit(f)(x, table), np.float32) for f in (apply_rope, reference))
    np.testing.assert_allclose(got, want, rtol=float(jnp.finfo(dtype).eps), atol=0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_pair_swap_is_exact(dtype):
    """The swapped pairs, compiled or not, are the reshaped pairs' bits (float32 at full precision too)."""
    x, _ = inputs(dtype)
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    want = np.asarray(jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape))
    for swap in (rope.pair_swapped, jax.jit(rope.pair_swapped)):
        got = swap(x)
        assert got.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(got), want)
    # every bit of a float32 significand, and the ends of its normal range, come through
    edges = np.asarray([1e-30, 3.0e38, -1.17549435e-38, 1 + 2**-23], np.float32)
    swapped = np.asarray(jax.jit(rope.pair_swapped)(jnp.asarray(edges)))
    np.testing.assert_array_equal(swapped, np.stack([-edges[1::2], edges[0::2]], axis=-1).reshape(-1))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_a_perturbed_table_is_seen(dtype):
    x, (cos, sin) = inputs(dtype)
    want = reference(x, (cos, sin))
    for table in ((cos, sin.at[5, 7].add(0.25)), (cos.at[9, 2].add(0.25), sin), (cos, -sin)):
        assert not np.array_equal(np.asarray(apply_rope(x, table), np.float32), np.asarray(want, np.float32))


def test_swap_matrix_pairs_channels():
    x = np.arange(1.0, 9.0, dtype=np.float32)
    np.testing.assert_array_equal(x @ rope.swap_matrix(8), [-2, 1, -4, 3, -6, 5, -8, 7])
    np.testing.assert_array_equal(np.asarray(rope.pair_swapped(jnp.asarray(x))), [-2, 1, -4, 3, -6, 5, -8, 7])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_heads_first_rotation_is_the_token_major_one(dtype):
    """The single blocks' QK-norm and RoPE computed heads first ([B, H, S, Dh]) give the token-major
    values: the same bits op by op."""
    x, table = inputs(dtype)
    norm = RMSNorm(x.shape[-1], 1e-6, dtype)
    norm.scale[...] = jnp.asarray(np.random.default_rng(1).uniform(0.5, 1.5, x.shape[-1]), dtype)

    def token_major(x, table):
        return apply_rope(norm(x), table)

    def heads_first(x, table):
        return blocks._normed_rotated(norm, x, table)

    np.testing.assert_array_equal(
        np.asarray(heads_first(x, table), np.float32), np.asarray(token_major(x, table), np.float32)
    )
    # Compiled, XLA:CPU may also sum the squares in another order: a few ulps of the terms summed.
    got, want = (np.asarray(jax.jit(f)(x, table), np.float32) for f in (heads_first, token_major))
    eps = float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(got, want, rtol=eps, atol=4 * eps * np.abs(want).max())
    swapped = jnp.swapaxes(x, 1, 2)
    np.testing.assert_array_equal(
        np.asarray(jnp.swapaxes(apply_rope(swapped, table, heads_first=True), 1, 2), np.float32),
        np.asarray(apply_rope(x, table), np.float32),
    )
    cos, sin = table
    assert not np.array_equal(
        np.asarray(heads_first(x, (cos, sin.at[3, 5].add(0.25))), np.float32),
        np.asarray(token_major(x, table), np.float32),
    )
