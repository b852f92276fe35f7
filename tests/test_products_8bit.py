"""8-bit products (`compute="fp8" | "int8"`, `klein.models.products`): each equal to its definition written
out here in NumPy (quantise per token and per output channel -> 8-bit product -> both scales in float32 ->
one rounding), sensitive to the order of scaling and rounding; the device's choice under "auto"; and the
demo pipeline computing in 8 bits under the residency policies `all` and `stream`, close to bf16."""

import types

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from klein import devices
from klein.errors import InputError
from klein.lora.kinds import LowRank
from klein.lora.merge import merge_kernel
from klein.lora.targets import Update
from klein.models import products
from klein.models.layers import Linear, quantised, store
from klein.models.stacks import as_float
from klein.pipeline.loading import load_pipeline
from tests.support import lora_files

TOP = {"fp8": 448.0, "int8": 127.0}
TYPE = {"fp8": ml_dtypes.float8_e4m3fn, "int8": np.int8}
D_IN, D_OUT, TOKENS = 256, 384, 24


def reference_quantise(values: np.ndarray, compute: str, axis: int):
    """The definition: one float32 scale per slice across `axis`, its largest magnitude times the float32
    reciprocal of the format's largest value; the values times the reciprocal of their scale, int8 rounded
    half to even, e4m3 to nearest even."""
    largest = np.abs(values.astype(np.float32)).max(axis, keepdims=True)
    scale = np.where(largest > 0, largest * np.float32(1 / TOP[compute]), np.float32(1)).astype(np.float32)
    scaled = np.clip(values.astype(np.float32) * (np.float32(1) / scale), -TOP[compute], TOP[compute])
    return (np.round(scaled) if compute == "int8" else scaled).astype(TYPE[compute]), scale


def reference_product(x: np.ndarray, kernel: np.ndarray, weight_scale: np.ndarray, compute: str):
    """Activations quantised per token, the 8-bit product summed exactly (float64: every product of two
    8-bit values and their sums here are exact), both scales applied in float32, one rounding to bf16."""
    values, tokens = reference_quantise(x, compute, -1)
    total = values.astype(np.float64) @ kernel.astype(np.float64)
    return (total.astype(np.float32) * tokens * weight_scale).astype(ml_dtypes.bfloat16), total, tokens


def _inputs(seed: int):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((2, TOKENS, D_IN)) * rng.uniform(0.1, 10, (2, TOKENS, 1))).astype(
        ml_dtypes.bfloat16
    )
    weight = (rng.standard_normal((D_IN, D_OUT)) * rng.uniform(0.01, 1, D_OUT)).astype(np.float32)
    return x, weight


@pytest.mark.parametrize("compute", ["fp8", "int8"])
def test_weights_quantised_per_channel_are_their_definition(compute):
    _, weight = _inputs(0)
    values, scale = products.quantise(weight, compute, 0)  # NumPy: as at load
    want_values, want_scale = reference_quantise(weight, compute, 0)
    np.testing.assert_array_equal(scale, want_scale)
    np.testing.assert_array_equal(values.view(np.uint8), want_values.view(np.uint8))
    jax_values, jax_scale = products.quantise(jnp.asarray(weight), compute, 0)  # JAX: as in a product
    np.testing.assert_array_equal(np.asarray(jax_scale), want_scale)
    np.testing.assert_array_equal(np.asarray(jax_values).view(np.uint8), want_values.view(np.uint8))
    assert (np.abs(values.astype(np.float32)).max(0) == TOP[compute]).all()  # the whole range is used


@pytest.mark.parametrize("compute", ["fp8", "int8"])
def test_an_8bit_product_is_its_definition(compute):
    x, weight = _inputs(1)
    kernel, scale = reference_quantise(weight, compute, 0)
    weight = products.Weight(jnp.asarray(kernel), jnp.asarray(scale[0]), compute=compute)
    got = products.product(jnp.asarray(x), weight, jnp.bfloat16)
    want, total, tokens = reference_product(x, kernel, scale[0], compute)
    assert got.dtype == jnp.bfloat16
    got, want = np.asarray(got, np.float32), want.astype(np.float32)
    if compute == "int8":  # int32 sums are exact: so is the result
        np.testing.assert_array_equal(got, want)
    else:  # float32 sums in another order: a bf16 rounding apart at most, beyond float32's summation error
        values, _ = reference_quantise(x, compute, -1)
        terms = np.abs(values.astype(np.float64)) @ np.abs(kernel.astype(np.float64)) * tokens * scale[0]
        assert (np.abs(got - want) <= np.abs(want) * 2.0**-7 + terms * D_IN * 2.0**-24).all()
        assert (got == want).mean() > 0.99
    # Sensitive: rounding to bf16 before the weight scale (two roundings), or one activation scale for
    # the whole tensor instead of one per token, are not the definition, and the check above tells them.
    twice = (total.astype(np.float32) * tokens).astype(ml_dtypes.bfloat16).astype(np.float32) * scale[0]
    assert (twice.astype(ml_dtypes.bfloat16).astype(np.float32) != want).mean() > 0.1
    flat_values, flat_scale = reference_quantise(x.reshape(-1), compute, 0)
    per_tensor = (flat_values.astype(np.float64).reshape(x.shape) @ kernel.astype(np.float64)).astype(
        np.float32
    )
    per_tensor = (per_tensor * flat_scale * scale[0]).astype(ml_dtypes.bfloat16).astype(np.float32)
    assert (per_tensor != want).mean() > 0.1


def test_an_fp8_product_with_the_files_activation_scale_is_its_definition():
    """An FP8 file's per-tensor `input_scale` replaces the per-token scales: activations clipped to
    448 of it, whatever their size (so a too small one shows)."""
    x, weight = _inputs(3)
    kernel, scale = reference_quantise(weight, "fp8", 0)
    given = np.float32(2 / 448)
    kernel_and_scale = jnp.asarray(kernel), jnp.asarray(scale[0])
    weight = products.Weight(*kernel_and_scale, jnp.asarray(given), compute="fp8")
    got = products.product(jnp.asarray(x), weight, jnp.bfloat16)
    values = np.clip(x.astype(np.float32) * (np.float32(1) / given), -448, 448).astype(
        ml_dtypes.float8_e4m3fn
    )
    total = (values.astype(np.float64) @ kernel.astype(np.float64)).astype(np.float32)
    want = (total * given * scale[0]).astype(ml_dtypes.bfloat16).astype(np.float32)
    got = np.asarray(got, np.float32)
    terms = np.abs(values.astype(np.float64)) @ np.abs(kernel.astype(np.float64)) * given * scale[0]
    assert (np.abs(got - want) <= np.abs(want) * 2.0**-7 + terms * D_IN * 2.0**-24).all()
    per_token = products.product(
        jnp.asarray(x), products.Weight(*kernel_and_scale, compute="fp8"), jnp.bfloat16
    )
    per_token = np.asarray(per_token)
    assert (per_token.astype(np.float32) != got).mean() > 0.5  # x reaches 30: clipped at 2 here


@pytest.mark.parametrize("compute", ["fp8", "int8"])
def test_a_stored_linear_runs_its_columns(compute):
    """A Linear stored 8-bit with per-channel scales: `columns` is the slice of the whole product."""
    x, weight = _inputs(2)
    layer = Linear(D_IN, D_OUT, nnx.Rngs(0), jnp.bfloat16)
    store(layer, {(): quantised(compute)})
    kernel, scale = reference_quantise(weight, compute, 0)
    assert layer.kernel is None and layer.weight[...].shape == (D_OUT, D_IN)  # [out, in]: an 8-bit GEMM's
    layer.weight[...], layer.weight_scale[...] = jnp.asarray(kernel.T), jnp.asarray(scale[0])
    whole = np.asarray(layer(jnp.asarray(x)), np.float32)
    np.testing.assert_array_equal(
        np.asarray(layer.columns(jnp.asarray(x), 100, 300), np.float32), whole[..., 100:300]
    )


@pytest.mark.parametrize("compute", ["fp8", "int8"])
def test_a_lora_merged_into_an_8_bit_stack_is_quantised_again_once_at_merge(compute):
    """A LoRA merged into a stack stored for 8-bit products (`weight` [L, out, in], scales per channel) is
    quantised again by the merge, per output channel, from the sum rounded to the compute dtype: the
    product then reads it as any kernel stored for it, and quantises no weight as it runs."""
    _, weight = _inputs(3)
    kernel, scale = reference_quantise(np.stack([weight.T, 2 * weight.T]), compute, -1)
    rng = np.random.default_rng(4)
    down, up = rng.standard_normal((4, D_IN)), rng.standard_normal((D_OUT, 4)) * 0.01
    updates = [(Update(("k",), 1, LowRank(down.astype(np.float32), up.astype(np.float32)), 0.5, None), 0.7)]
    got, got_scale = merge_kernel(kernel, scale[..., 0], updates, jnp.bfloat16, out_in=True, compute=compute)
    widened, ones = merge_kernel(kernel, scale[..., 0], updates, jnp.bfloat16, out_in=True)
    np.testing.assert_array_equal(ones, np.ones((2, D_OUT), np.float32))
    want, want_scale = reference_quantise(np.asarray(as_float(widened)), compute, -1)
    np.testing.assert_array_equal(np.asarray(as_float(got)).view(np.uint8), want.view(np.uint8))
    np.testing.assert_array_equal(got_scale, want_scale[..., 0])
    assert not np.array_equal(want[1].view(np.uint8), kernel[1].view(np.uint8))  # the update shows


def _device(platform, kind, capability=None):
    return types.SimpleNamespace(platform=platform, device_kind=kind, compute_capability=capability)


@pytest.mark.parametrize(
    ("device", "compute"),
    [
        (_device("gpu", "NVIDIA H100 80GB HBM3", "9.0"), "fp8"),
        (_device("gpu", "NVIDIA GeForce RTX 4090", "8.9"), "fp8"),
        (_device("gpu", "NVIDIA GeForce RTX 3090", "8.6"), "int8"),
        (_device("gpu", "NVIDIA A100-SXM4-80GB", "8.0"), "int8"),
        (_device("tpu", "TPU7x"), "fp8"),
        (_device("tpu", "TPU v6 lite"), "int8"),
        (_device("tpu", "TPU v5 lite"), "int8"),
        (_device("cpu", "cpu"), "bf16"),
    ],
)
def test_auto_picks_what_the_device_multiplies_fastest(device, compute):
    assert devices.auto_compute(device) == compute


@pytest.mark.parametrize(("dtype", "compute"), [("float32", "bf16"), ("bfloat16", "int8")])
def test_auto_keeps_a_float32_pipeline_in_float32(klein_home, monkeypatch, dtype, compute):
    """On a device whose fastest product is int8 (a v5e), `auto` quantises a bf16 pipeline only: a float32
    one keeps its float32 products (on a v5e, int8 took the demo's float32 images 8e-3 to 3e-2 from the
    CPU's)."""
    monkeypatch.setattr(devices, "auto_compute", lambda device: "int8")
    assert load_pipeline(dtype=dtype).compute == compute


def test_an_unknown_compute_is_refused_before_anything_loads():
    with pytest.raises(
        InputError, match="compute must be one of auto, bf16, fp8, int8, nvfp4, mxfp8, got 'fp4'"
    ):
        load_pipeline(compute="fp4")


def _image(pipe) -> np.ndarray:
    return np.asarray(
        pipe("a red fox", height=64, width=64, num_inference_steps=2, seed=3).images[0], np.float32
    )


@pytest.fixture(scope="module")
def bf16_image(klein_home):
    return _image(load_pipeline(compute="bf16", residency="all"))


@pytest.mark.parametrize(("compute", "residency"), [("fp8", "stream"), ("int8", "all")])
def test_the_demo_computes_in_8_bits_close_to_bf16(klein_home, bf16_image, tmp_path, compute, residency):
    """Under `all` and `stream` (the layers brought from host memory one at a time): one each, since
    both read the same stacks through `klein.models.stacks.layer`. A LoRA set and taken away again
    leaves the 8-bit weights as they were, bit for bit."""
    pipe = load_pipeline(compute=compute, residency=residency)
    assert (pipe.compute, pipe.residency) == (compute, residency)
    state = dict(nnx.to_flat_state(pipe._models["transformer"].get()[1]))
    kernel = ("single_transformer_blocks", "attn", "to_qkv_mlp_proj", "weight")  # [L, out, in]
    stored = state[kernel].get_value()
    assert stored.dtype == (jnp.uint8 if compute == "fp8" else jnp.int8)  # a float8 stack as its bits
    assert state[(*kernel[:-1], "weight_scale")].get_value().shape == stored.shape[:2]
    assert stored.shape[1] > stored.shape[2]  # the fused projection: out (3 D + 2 M) over in (D)
    image = _image(pipe)
    error = np.abs(image - bf16_image)
    assert 0 < error.mean() < 3.0, error.mean()  # 8-bit differs from bf16, and only a little
    if residency == "all":  # a LoRA merges into the 8-bit layers, quantised again as they are merged
        shapes = lora_files.linear_shapes(pipe.config, "peft")
        lora = lora_files.write_peft(tmp_path / "a.safetensors", lora_files.random_lora(shapes, 4, 0))
        pipe.set_loras([(lora, 1.0)])
        assert np.abs(_image(pipe) - image).mean() > 5  # the LoRA shows
        pipe.set_loras([])
        restored = dict(nnx.to_flat_state(pipe._models["transformer"].get()[1]))
        assert all(np.array_equal(restored[p].get_value(), state[p].get_value()) for p in state)
        np.testing.assert_array_equal(_image(pipe), image)
