"""Float32-accurate transcendentals (`klein.models.transcendentals`): what a float32 program asks a TPU for,
checked on its lowering for a TPU from this machine; and that nothing changes for any other platform."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from klein.models import transcendentals as T
from klein.pipeline import programs

X = jnp.asarray(np.linspace(-90.0, 90.0, 4001), jnp.float32)


def both(x):
    return T.silu(x), T.exp(x / 8)


def tpu_lowering(fn) -> str:
    try:
        return jax.jit(fn).trace(X).lower(lowering_platforms=("tpu",)).as_text()
    except Exception as error:  # no TPU lowering in this environment
        pytest.skip(f"cannot lower for a TPU here: {error}")


def test_a_cpu_program_is_the_same_inside_and_out():
    with jax.default_matmul_precision("highest"):
        inside = jax.jit(both)(X)
    outside = jax.jit(both)(X)
    for a, b in zip(inside, outside, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_float32_program_asks_a_tpu_for_its_most_accurate_exp():
    with jax.default_matmul_precision("highest"):
        inside = tpu_lowering(both)
    outside = tpu_lowering(both)
    highest = "result_accuracy_mode<HIGHEST>"
    assert highest in inside and highest not in outside
    # SiLU is built from that exponential there: a TPU's logistic ignores the accuracy asked of it.
    tpu_branch = inside.split("stablehlo.logistic")
    assert inside.count(highest) >= 2, inside
    assert len(tpu_branch) <= 2  # at most the other platforms' branch keeps jax.nn.silu's logistic


def test_the_accurate_silu_is_silu():
    x64 = np.asarray(X, np.float64)
    want = x64 / (1 + np.exp(-x64))
    got = np.asarray(jax.jit(T._accurate_silu)(X), np.float64)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=3e-7, atol=1e-30)


@pytest.mark.parametrize("dtype, precise", [(jnp.float32, True), (jnp.bfloat16, False)])
def test_float32_programs_trace_under_it(dtype, precise):
    with programs._products(programs.products_precision(dtype)):
        assert T.is_precise() is precise
    assert not T.is_precise()
