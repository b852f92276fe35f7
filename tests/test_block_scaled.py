"""Block-scaled products (`compute="nvfp4" | "mxfp8"`, `klein.models.block_scaled`): the block quantisation
against a NumPy reference written from the formats' definitions, a Linear's product of the stored blocks
(emulated here: XLA:CPU has no block-scaled GEMM) against that reference's product, its error within the
format's, and the compute chosen at load."""

import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax import numpy as jnp

from klein.io import transformer_checkpoint
from klein.models import block_scaled, products
from klein.pipeline.loading import load_pipeline

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)


def reference(values: np.ndarray, compute: str) -> np.ndarray:
    """`values` [rows, K] as the format holds them, in float32: NVFP4 scales each block by an E4M3 of its
    largest magnitude over 6 (over a tensor scale of the largest over 6 x 448) and rounds to the nearest
    E2M1 (ties to the even code); MXFP8 by the power of two at or above its largest over 448, then E4M3."""
    rows, width = values.shape
    if compute == "nvfp4":
        tensor = np.abs(values).max() / (6 * 448)
        blocks = values.reshape(rows, -1, 16) / tensor
        scales = (
            (np.abs(blocks).max(-1, keepdims=True) / 6).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
        )
        scaled = np.abs(blocks / scales)
        distance = np.abs(scaled[..., None] - E2M1)
        # nearest, a tie to the even code (the lower index among equals is taken if its index is even)
        code = np.argmin(distance + 1e-6 * (np.arange(8) % 2), axis=-1)
        return (np.sign(blocks) * E2M1[code] * scales * tensor).reshape(rows, width)
    blocks = values.reshape(rows, -1, 32)
    scales = 2.0 ** np.ceil(np.log2(np.abs(blocks).max(-1, keepdims=True) / 448))
    elements = (blocks / scales).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return (elements * scales).reshape(rows, width)


# The format's error of one product of normal values (relative, Frobenius): E2M1 keeps 1 mantissa bit,
# E4M3 3; measured 0.116 / 0.100 (NVFP4) and 0.032 / 0.027 (MXFP8) for the product / the weight alone.
BOUND = {"nvfp4": (0.08, 0.15), "mxfp8": (0.015, 0.045)}


@pytest.mark.parametrize("compute", products.BLOCK_SCALED)
def test_a_block_scaled_linear_is_the_formats_product(compute):
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((96, 256)).astype(np.float32)
    x = (rng.standard_normal((2, 7, 256)) * np.linspace(0.1, 3, 256)).astype(np.float32)
    rows, tensor = block_scaled.rows_of_blocks(weight, compute)
    assert rows.shape == (96, products.packed_width(compute, 256)) and rows.dtype == np.uint8
    # The weight as stored is the reference's quantisation, exactly (widened by `dense`).
    stored = products.Weight(
        jnp.asarray(rows), jnp.asarray(tensor) if compute == "nvfp4" else None, compute=compute, out_in=True,
        blocks=compute,
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(products.dense(stored)), reference(weight, compute))
    out = np.asarray(products.product(jnp.asarray(x), stored, jnp.float32))
    wanted = reference(x.reshape(14, 256), compute) @ reference(weight, compute).T
    np.testing.assert_allclose(out.reshape(14, 96), wanted, rtol=1e-5, atol=1e-4)
    exact = x.reshape(14, 256) @ weight.T
    error = np.linalg.norm(out.reshape(14, 96) - exact) / np.linalg.norm(exact)
    assert BOUND[compute][0] < error < BOUND[compute][1], error


def test_block_linears_are_quantised_at_load_and_an_nvfp4_files_blocks_kept():
    """The blocks' Linears quantised into the compute's blocks at load, an NVFP4 file's blocks multiplied
    as stored under nvfp4 (widened under mxfp8 or bf16), the Linears outside the blocks left as they are."""
    plan = {("transformer_blocks", "attn", "kernel"): ["a.weight"], ("single_transformer_blocks", "mlp", "kernel"): ["b.weight"],
            ("final", "kernel"): ["c.weight"]}  # fmt: skip
    filed = {("single_transformer_blocks", "mlp"): "nvfp4"}
    for compute in products.BLOCK_SCALED:
        forms = transformer_checkpoint.stored_forms(plan, compute=compute, blocks=filed)
        assert (
            forms[("transformer_blocks", "attn")].compute == compute
            and forms[("transformer_blocks", "attn")].at_load
        )
        assert forms[("single_transformer_blocks", "mlp")].compute == (
            compute if compute == "nvfp4" else "bf16"
        )
        assert ("final",) not in forms
        assert transformer_checkpoint.quantised_keys(plan, forms) == {"a.weight": compute}


def test_e2m1_codes_counted_are_the_conversions():
    """`block_scaled.e2m1` (codes counted from midpoints, NumPy and JAX) rounds as a conversion to
    float4_e2m1fn does, ties to even included."""
    values = np.concatenate([np.linspace(-6, 6, 4801), [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -5, -0.25]])
    values = values.astype(np.float32)
    wanted = values.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(block_scaled.e2m1(values).astype(np.float32), wanted)
    np.testing.assert_array_equal(
        np.asarray(block_scaled.e2m1(jnp.asarray(values)).astype(jnp.float32)), wanted
    )


@pytest.mark.parametrize("compute", products.BLOCK_SCALED)
def test_the_demo_loads_and_runs_block_scaled(klein_home, compute):
    """`compute=` reaches the blocks: their kernels quantised at load into rows of blocks, the image
    near the bf16 one (the demo's tiny random model: a loose bound, 4 bits further than 8)."""

    def image(pipe):
        return np.asarray(
            pipe("a red fox", height=64, width=64, num_inference_steps=2, seed=3).images[0], float
        )

    pipe = load_pipeline(compute=compute, residency="all")
    assert pipe.compute == compute
    state = dict(nnx.to_flat_state(pipe._models["transformer"].get()[1]))
    stored = state[("single_transformer_blocks", "attn", "to_qkv_mlp_proj", "weight")].get_value()
    assert stored.dtype.itemsize == 1 and stored.ndim == 3  # [L, out, bytes]
    error = np.abs(image(pipe) - image(load_pipeline(compute="bf16", residency="all"))).mean()
    assert 0 < error < (6.0 if compute == "nvfp4" else 3.0), error
