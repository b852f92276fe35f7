"""BFL FP8 single files: weights kept as float8 in device memory (or dequantised at load) equal diffusers
run on the dequantised weights; partly quantised stacks and broken headers."""

import copy
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers
from flax import nnx

from klein.errors import CheckpointError
from klein.io.transformer_file import load_transformer_file
from klein.models.stacks import as_float
from tests.support.bfl_files import dequantize_fp8, quantize_fp8, to_bfl, write_safetensors
from tests.support.compare import assert_close, rel_err
from tests.support.single_file_cases import both_outputs
from tests.support.transformer_inputs import make_case, torch_call

# Both sides compute in float32 with the same weight values (float8 values are exact in float32; only where
# the per-tensor scale is applied differs: to the output here, to the weight in the reference), so the only
# differences are rounding and summation order, ~2e-6 here as in the fp32 parity tests.
TOL = 1e-5


def fp8_file(tiny_transformer, path, skip=lambda key: False):
    """Write an FP8 file of the tiny transformer; return it with diffusers holding its dequantised weights."""
    tensors, metadata = quantize_fp8(to_bfl(tiny_transformer[1].state_dict()), skip)
    reference = copy.deepcopy(tiny_transformer[1])
    reference.load_state_dict(convert_flux2_transformer_checkpoint_to_diffusers(dequantize_fp8(tensors)))
    return write_safetensors(path, tensors, metadata), reference, tensors, metadata


@pytest.fixture(scope="module")
def fp8(tiny_transformer, tmp_path_factory):
    return fp8_file(tiny_transformer, tmp_path_factory.mktemp("fp8") / "flux-2-klein-tiny-fp8.safetensors")


def kernels(model):
    return {
        p: as_float(v.get_value())
        for p, v in nnx.to_flat_state(nnx.state(model))
        if p[-1] in ("kernel", "weight_scale")
    }


def test_weights_stay_float8_and_equal_the_dequantised_reference(fp8, tiny_transformer):
    path, reference, _, _ = fp8
    ours = load_transformer_file(path)
    for p, value in kernels(ours).items():
        assert value.dtype == (jnp.float8_e4m3fn if p[-1] == "kernel" else jnp.float32), p
    got, want = both_outputs(ours, reference)
    assert_close(got, want, TOL)
    # Not vacuous: FP8 rounding moves the output far more than the tolerance.
    assert rel_err(want, torch_call(tiny_transformer[1], make_case(0, 2))[0].numpy()) > 100 * TOL


def test_dequantised_at_load_equals_it_too(fp8):
    path, reference, _, _ = fp8
    kept = load_transformer_file(path)
    widened = load_transformer_file(path, dequantize=True)
    assert all(v.dtype == jnp.float32 for v in kernels(widened).values())
    assert not any(p[-1] == "weight_scale" for p in kernels(widened))
    got, want = both_outputs(widened, reference)
    assert_close(got, want, TOL)
    assert_close(got, both_outputs(kept, reference)[0], TOL)


def test_bfloat16_compute(fp8):
    """FP8 weights widened to bf16 inside the matmul are as accurate as the same weights dequantised to
    bf16 at load: both ~0.7% off the float32 reference here, bf16's rounding (2^-9) through four blocks."""
    path, reference, _, _ = fp8
    kept = load_transformer_file(path, dtype=jnp.bfloat16)
    widened = load_transformer_file(path, dtype=jnp.bfloat16, dequantize=True)
    assert kept.x_embedder.kernel[...].dtype == jnp.float8_e4m3fn
    assert widened.x_embedder.kernel[...].dtype == jnp.bfloat16
    for model in (kept, widened):
        got, want = both_outputs(model, reference)
        assert_close(got, want, 1.5e-2)


def test_comfy_quant_markers_instead_of_the_header(fp8, tmp_path):
    """ComfyUI's per-layer `comfy_quant` tensors (the layer's JSON as bytes) declare the same layers."""
    path, reference, tensors, metadata = fp8
    layers = json.loads(metadata["_quantization_metadata"])["layers"]
    markers = {
        f"{layer}.comfy_quant": torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)
        for layer, conf in layers.items()
    }
    marked = write_safetensors(tmp_path / "marked.safetensors", {**tensors, **markers})
    ours = load_transformer_file(marked)
    assert ours.proj_out.kernel[...].dtype == jnp.float8_e4m3fn
    got, want = both_outputs(ours, reference)
    assert_close(got, want, TOL)


def test_a_stack_quantised_in_some_layers_only_is_dequantised(tiny_transformer, tmp_path):
    path, reference, _, _ = fp8_file(
        tiny_transformer,
        tmp_path / "mixed.safetensors",
        skip=lambda key: key.startswith("double_blocks.1.img_attn"),
    )
    ours = load_transformer_file(path)
    assert as_float(ours.transformer_blocks.attn.to_q.kernel[...]).dtype == jnp.float32
    assert as_float(ours.transformer_blocks.attn.to_out.kernel[...]).dtype == jnp.float32
    assert as_float(ours.transformer_blocks.attn.add_q_proj.kernel[...]).dtype == jnp.float8_e4m3fn
    got, want = both_outputs(ours, reference)
    assert_close(got, want, TOL)


def test_missing_scale(fp8, tmp_path):
    _, _, tensors, metadata = fp8
    broken = {k: v for k, v in tensors.items() if k != "double_blocks.0.img_attn.qkv.weight_scale"}
    path = write_safetensors(tmp_path / "broken.safetensors", broken, metadata)
    with pytest.raises(
        CheckpointError, match="FP8 layer 'double_blocks.0.img_attn.qkv' has no tensor '.*weight_scale'"
    ):
        load_transformer_file(path)


def test_per_row_scales_are_refused(fp8, tmp_path):
    _, _, tensors, metadata = fp8
    rows = tensors["img_in.weight"].shape[0]
    broken = {**tensors, "img_in.weight_scale": tensors["img_in.weight_scale"].repeat(rows)}
    path = write_safetensors(tmp_path / "rows.safetensors", broken, metadata)
    with pytest.raises(
        CheckpointError, match=r"'img_in.weight_scale' has shape \(32,\); klein reads per-tensor"
    ):
        load_transformer_file(path)


def test_float8_weight_missing_from_the_header(fp8, tmp_path):
    _, _, tensors, metadata = fp8
    header = json.loads(metadata["_quantization_metadata"])
    del header["layers"]["img_in"]
    path = write_safetensors(
        tmp_path / "broken.safetensors", tensors, {"_quantization_metadata": json.dumps(header)}
    )
    with pytest.raises(CheckpointError, match="'img_in.weight' is float8 but the header"):
        load_transformer_file(path)


def test_other_quantisation_formats_are_refused(fp8, tmp_path):
    _, _, tensors, metadata = fp8
    header = json.loads(metadata["_quantization_metadata"])
    header["layers"]["img_in"] = {"format": "mxfp8"}
    path = write_safetensors(
        tmp_path / "mxfp8.safetensors", tensors, {"_quantization_metadata": json.dumps(header)}
    )
    with pytest.raises(
        CheckpointError, match="'img_in' is quantised as 'mxfp8'; klein reads float8_e4m3fn and nvfp4"
    ):
        load_transformer_file(path)
    header["layers"]["img_in"] = {"format": "nvfp4"}  # but its tensors are FP8's
    path = write_safetensors(
        tmp_path / "nvfp4.safetensors", tensors, {"_quantization_metadata": json.dumps(header)}
    )
    with pytest.raises(CheckpointError, match="NVFP4 layer 'img_in' has no tensor 'img_in.weight_scale_2'"):
        load_transformer_file(path)


def test_device_bytes_halve(fp8, tiny_transformer):
    """float8 kernels take a quarter of the float32 bytes; the scales add 4 bytes per tensor and layer."""
    path, _, _, _ = fp8
    kept = load_transformer_file(path)
    widened = load_transformer_file(path, dequantize=True)
    nbytes = [sum(np.asarray(v).nbytes for v in kernels(m).values()) for m in (kept, widened)]
    assert nbytes[0] < 0.26 * nbytes[1]


torch.set_grad_enabled(False)


@pytest.mark.parametrize("compute", ["fp8", "int8"])
def test_8bit_products_from_an_fp8_file(fp8, tmp_path, compute):
    """compute="fp8": the blocks' FP8 weights as shipped (per-tensor scales) beside the file's activation
    scales; "int8": the same weights quantised again per channel, activations per token. Modulations and
    embedders stay FP8 widened inside bf16 products. Both near the dequantised reference, with 8 bits'
    error: activations rounded too."""
    _, reference, tensors, metadata = fp8
    # The test file's activation scales (1/448) clip activations at 1; a calibrated file's leave them room.
    roomy = {k: v * 64 if k.endswith(".input_scale") else v for k, v in tensors.items()}
    ours = load_transformer_file(
        write_safetensors(tmp_path / "scaled.safetensors", roomy, metadata), compute=compute
    )
    to_q = ours.transformer_blocks.attn.to_q
    # Stored [L, out, in] for the 8-bit GEMM (square here: the outputs below tell the layouts apart).
    assert to_q.kernel is None and ours.x_embedder.weight is None
    layers, width = to_q.weight[...].shape[:2]
    assert to_q.compute == compute and ours.x_embedder.compute == "bf16"
    if compute == "fp8":
        assert as_float(to_q.weight[...]).dtype == jnp.float8_e4m3fn and to_q.weight_scale[...].shape == (
            layers,
        )
        np.testing.assert_array_equal(to_q.input_scale[...], np.full(layers, 64 / 448, np.float32))
    else:
        assert to_q.weight[...].dtype == jnp.int8 and to_q.weight_scale[...].shape == (layers, width)
        assert to_q.input_scale is None
    got, want = both_outputs(ours, reference)
    assert 10 * TOL < rel_err(want, got) < 0.05, rel_err(want, got)
