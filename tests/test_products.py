"""Products with bf16 weights (`klein.models.products`) and lookups in bf16 tables (`klein.models.stacks.rows`):
float32 accumulation rounded once, and no float32 copy of a weight where the backend multiplies bf16 as it is.
Memory is read from XLA's analysis of the compiled programs (nothing is timed)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from klein.io.loading import stored_state
from klein.io.text_encoder_checkpoint import STACKED as TEXT_STACKED
from klein.io.text_encoder_checkpoint import abstract_text_encoder
from klein.models import products, qwen3, stacks
from klein.models.layers import Linear
from klein.models.qwen3_config import Qwen3Config
from tests.support.platforms import cpu_only

D_IN, D_OUT = 512, 2048
WIDENED = D_IN * D_OUT * 4  # the kernel in float32


XLA_CPU_MEMORY = cpu_only(
    "XLA:CPU's memory analysis; a TPU lays out its temporaries its own way (failed on a v5e)"
)


def _temporaries(fn, *args) -> int:
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("rows", [1, 2, 33])
def test_a_bf16_linear_is_the_float32_product_rounded_once(rows):
    layer = Linear(D_IN, D_OUT, nnx.Rngs(0), jnp.bfloat16)
    x = jax.random.normal(jax.random.key(rows), (1, rows, D_IN), jnp.bfloat16)
    got = layer(x)
    assert got.dtype == jnp.bfloat16 and got.shape == (1, rows, D_OUT)
    exact = np.asarray(x, np.float32) @ np.asarray(layer.kernel[...], np.float32)
    rounded = np.asarray(exact.astype(jnp.bfloat16), np.float32)
    got = np.asarray(got, np.float32)
    # Sums in another order may round to the neighbouring bf16 value, rarely; never further.
    assert (np.abs(got - rounded) <= np.abs(rounded) * 2.0**-7 + 1e-30).all()
    assert (got == rounded).mean() > 0.98


@pytest.mark.parametrize("rows", [1, 16])
@XLA_CPU_MEMORY
def test_a_bf16_product_holds_no_float32_copy_of_its_weight_where_the_backend_can(rows):
    """Where the compiler multiplies bf16 into float32 in place (`in_place`), no product widens its
    weight, a single row included; where it cannot, the planner counts the widened copies instead
    (`klein.memory.activations.layer_copies` in float32), and the plain product widens."""
    layer = Linear(D_IN, D_OUT, nnx.Rngs(0), jnp.bfloat16)
    graphdef, state = nnx.split(layer)
    x = jax.ShapeDtypeStruct((1, rows, D_IN), jnp.bfloat16)
    used = _temporaries(lambda state, x: nnx.merge(graphdef, state)(x), state, x)
    widening = _temporaries(lambda k, x: x @ k, layer.kernel[...], x)
    if products.in_place(jax.default_backend()):
        assert used < WIDENED / 4, used
    else:
        assert used >= WIDENED
    if jax.default_backend() == "cpu":
        assert widening >= WIDENED  # XLA:CPU's plain bf16 product widens: the check can fail


@XLA_CPU_MEMORY
def test_the_text_encoder_runs_in_bf16_and_looks_up_rows_of_the_stored_table():
    """A bf16 text encoder computes in bf16, as transformers' does, and takes rows of its stored table
    (`klein.models.stacks.rows`). `nnx.Embed` gave float32 rows (its default dtype), so every layer ran in
    float32 with widened weights: 0.72 GiB of temporaries here instead of 0.38."""
    config = Qwen3Config.qwen3_8b()  # two of its layers
    graphdef, state = stored_state(abstract_text_encoder(config, 2, jnp.bfloat16), jnp.bfloat16, TEXT_STACKED)
    ids = jax.ShapeDtypeStruct((1, 512), jnp.int32)

    def embed(state, ids):
        return qwen3.prompt_embeddings(nnx.merge(graphdef, state), ids, ids, layers=(1, 2))

    assert jax.eval_shape(embed, state, ids).dtype == jnp.bfloat16
    assert _temporaries(embed, state, ids) < 0.5 * 2**30
    values = jax.random.normal(jax.random.key(0), (64, 8), jnp.bfloat16)
    picks = jnp.asarray([[3, 0, 63, 3]])
    np.testing.assert_array_equal(np.asarray(stacks.rows(values, picks)), np.asarray(values)[[[3, 0, 63, 3]]])
