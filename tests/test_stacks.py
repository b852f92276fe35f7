"""`klein.models.stacks.scan`: a loop over the layers of stacks, a prefix of them, or none."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from klein.models import stacks


def body(carry, layers):
    weight, index = layers
    return carry * weight + index, (carry.sum(), weight.astype(jnp.float32))


def test_a_scan_runs_the_first_count_layers_as_a_python_loop():
    weights = np.arange(1, 13, dtype=np.float32).reshape(4, 3).astype(ml_dtypes.bfloat16)
    carry = jnp.ones(3, jnp.float32)
    got, (sums, seen) = jax.jit(lambda c: stacks.scan(body, c, (stacks.as_bits(weights), jnp.arange(4)), 3))(
        carry
    )
    want = np.ones(3, np.float32)
    for i in range(3):
        want = want * weights[i].astype(np.float32) + i
    np.testing.assert_array_equal(got, want)
    assert sums.shape == (3,) and seen.shape == (3, 3)
    np.testing.assert_array_equal(seen, weights[:3].astype(np.float32))


def test_a_scan_over_no_layers_returns_the_carry_and_empty_ys():
    """Of stacks that have layers, and of stacks of none (a per-layer index `jnp.arange(0)`): nothing is
    sliced, the carry comes back as it went in, each ys has no rows and the body's shape and dtype."""
    carry = jnp.asarray([1.0, 2.0, 3.0])
    for length in (4, 0):
        weights = stacks.as_bits(jnp.ones((length, 3), jnp.bfloat16))
        for run in (stacks.scan, jax.jit(stacks.scan, static_argnums=(0, 3))):
            got, (sums, seen) = run(body, carry, (weights, jnp.arange(length)), 0)
            np.testing.assert_array_equal(got, carry)
            assert (sums.shape, sums.dtype) == ((0,), jnp.float32)
            assert (seen.shape, seen.dtype) == ((0, 3), jnp.float32)
