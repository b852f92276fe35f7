"""NVFP4 files in both published layouts (`klein.io.nvfp4_file`): ComfyUI's (high nibble first, block scales
swizzled in cuBLAS's tiles; the file declares its layers) and NVIDIA ModelOpt's (low nibble first, scales
row-major [out, in / 16]; the file declares nothing) read to the same values, also where the two take the
same bytes (out a multiple of 128, in / 16 of 4) and only the declaration tells them apart; a declared
file whose scales have ModelOpt's shape, and an undeclared one whose scales have ComfyUI's, are refused."""

import json

import jax
import numpy as np
import pytest
import torch
from flax import nnx

from klein.errors import CheckpointError
from klein.io import nvfp4_file
from klein.io.fp8 import quantised_layers
from klein.io.safetensors import TensorSource
from klein.io.transformer_file import load_transformer_file
from klein.models import nvfp4
from tests.support.bfl_files import to_bfl, write_safetensors
from tests.test_quantised_forms import nvfp4_reference, random_nvfp4

SCALE = 0.25
DECLARED = {"format_version": "1.0", "layers": {"layer": {"format": "nvfp4"}}}


def as_modelopt(packed: np.ndarray, swizzled: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The same values as ModelOpt lays them out: nibbles swapped, scales unswizzled to [out, in / 16]."""
    rows, half = packed.shape
    return (packed << 4) | (packed >> 4), nvfp4.block_scales(swizzled, rows, half * 2 // nvfp4.BLOCK)


def layer_tensors(layer: str, packed: np.ndarray, scales: np.ndarray, scale: float = SCALE) -> dict:
    return {
        f"{layer}.weight": torch.from_numpy(packed),
        f"{layer}.weight_scale": torch.from_numpy(np.ascontiguousarray(scales).view(np.uint8)).view(
            torch.float8_e4m3fn
        ),
        f"{layer}.weight_scale_2": torch.tensor(scale, dtype=torch.float32),
    }


def one_layer(path, packed, scales, declared: bool) -> TensorSource:
    tensors = layer_tensors("layer", packed, scales)
    metadata = {"_quantization_metadata": json.dumps(DECLARED)} if declared else None
    return TensorSource.from_file(write_safetensors(path, tensors, metadata))


def values(source: TensorSource) -> np.ndarray:
    assert quantised_layers(source, "test") == {"layer": "nvfp4"}
    return nvfp4_file.Values(source).get("layer.weight")


def test_both_layouts_read_to_the_formats_values_where_they_take_the_same_bytes(tmp_path):
    rows, columns = 256, 128  # 2 x 2 tiles of scales, no padding: both layouts are 2048 bytes of scales
    packed, swizzled = random_nvfp4(rows, columns, np.random.default_rng(5))
    want = nvfp4_reference(packed, swizzled, rows, columns) * np.float32(SCALE)
    comfyui = values(one_layer(tmp_path / "comfyui.safetensors", packed, swizzled, declared=True))
    modelopt_packed, row_major = as_modelopt(packed, swizzled)
    assert row_major.size == swizzled.size
    modelopt = values(
        one_layer(tmp_path / "modelopt.safetensors", modelopt_packed, row_major, declared=False)
    )
    np.testing.assert_array_equal(comfyui, want)
    np.testing.assert_array_equal(modelopt, want)
    # ModelOpt's bytes under a ComfyUI declaration: read as ComfyUI reads them, another weight altogether.
    misread = values(one_layer(tmp_path / "declared.safetensors", modelopt_packed, row_major, declared=True))
    assert np.mean(misread != want) > 0.5


def transformer_files(model, folder):
    """The tiny transformer's BFL tensors with every block Linear replaced by the same random NVFP4 values
    in ComfyUI's layout (declared) and in ModelOpt's (not), the rest as they are."""
    rng = np.random.default_rng(3)
    comfyui, modelopt, layers = {}, {}, {}
    for key, tensor in to_bfl(model.state_dict()).items():
        if key.startswith(("double_blocks.", "single_blocks.")) and tensor.ndim == 2:
            layer = key.removesuffix(".weight")
            packed, swizzled = random_nvfp4(*tensor.shape, rng)
            comfyui |= layer_tensors(layer, packed, swizzled)
            modelopt |= layer_tensors(layer, *as_modelopt(packed, swizzled))
            layers[layer] = {"format": "nvfp4"}
        else:
            comfyui[key] = modelopt[key] = tensor
    header = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})}
    return (
        write_safetensors(folder / "flux-2-klein-tiny-nvfp4.safetensors", comfyui, header),
        write_safetensors(folder / "flux-2-klein-tiny-nvfp4-modelopt.safetensors", modelopt),
    )


def test_a_modelopt_transformer_keeps_the_comfyui_files_blocks(tiny_transformer, tmp_path):
    comfyui, modelopt = (
        load_transformer_file(path) for path in transformer_files(tiny_transformer[1], tmp_path)
    )
    ours, theirs = (jax.tree.leaves(jax.tree.map(np.asarray, nnx.state(m))) for m in (comfyui, modelopt))
    assert len(ours) == len(theirs) and sum(a.dtype == np.uint8 for a in ours) >= 4
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    ("declared", "message"),
    [
        (True, r"ModelOpt's row-major \[out, in / 16\] layout; the file declares its layers as ComfyUI does"),
        (False, r"read in NVIDIA ModelOpt's layout, whose block scales are \[out, in / 16\] = \(136, 6\)"),
    ],
)
def test_scales_in_the_other_layout_are_refused(tmp_path, declared, message):
    """136 rows pad to 256 in ComfyUI's tiles: the two layouts differ in size, and the wrong one is named."""
    packed, swizzled = random_nvfp4(136, 96, np.random.default_rng(6))
    modelopt_packed, row_major = as_modelopt(packed, swizzled)
    scales = row_major if declared else swizzled
    source = one_layer(tmp_path / "wrong.safetensors", modelopt_packed, scales, declared=declared)
    with pytest.raises(CheckpointError, match=message):
        quantised_layers(source, "wrong.safetensors")
