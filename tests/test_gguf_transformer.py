"""GGUF transformers written with the `gguf` package: Q8_0 / Q4_0 (gguf's own quantiser) on the tiny
fixture, K-quants (random blocks) on a wider one whose rows fill 256-value super-blocks, mixed with
BF16 / F16 / F32 tensors; each equals diffusers run on the dequantised weights. Unknown types are refused."""

import copy

import gguf
import numpy as np
import pytest
import torch
from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

from klein.errors import CheckpointError
from klein.io.transformer_file import load_transformer_file
from klein.pipeline.checkpoints import variant_of_file
from tests.support.bfl_files import random_k_quant, to_bfl, write_gguf
from tests.support.compare import assert_close
from tests.support.single_file_cases import both_outputs
from tests.support.tiny_transformer import build_transformer

Q = gguf.GGMLQuantizationType
# Weights are dequantised to float32 at load, by the same gguf code the reference uses: only float
# rounding and summation order differ, as in the float32 parity tests.
TOL = 1e-5
# Wide enough that every projection but img_in (128 inputs) is whole 256-value K-quant super-blocks.
WIDE = dict(
    attention_head_dim=128,
    axes_dims_rope=(32,) * 4,
    joint_attention_dim=256,
    num_layers=1,
    num_single_layers=1,
)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    return build_transformer(tmp_path_factory.mktemp("wide"), **WIDE)


def gguf_tensors(model, weight_type, rng):
    """(tensors, types): 2-D weights as `weight_type` (K-quants only where rows are whole super-blocks,
    else Q8_0), RMSNorm scales alternately F16 and F32, the timestep embedder in BF16."""
    tensors, types = {}, {}
    for i, (key, tensor) in enumerate(sorted(to_bfl(model.state_dict()).items())):
        tensors[key] = tensor.numpy()
        if key.startswith("time_in."):
            types[key] = Q.BF16
        elif tensor.ndim == 1:
            types[key] = Q.F16 if i % 2 else Q.F32
        elif weight_type in (Q.Q4_K, Q.Q5_K, Q.Q6_K) and tensor.shape[1] % 256 == 0:
            tensors[key], types[key] = random_k_quant(tensor.shape, weight_type, rng), weight_type
        else:
            types[key] = Q.Q8_0 if weight_type in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else weight_type
    return tensors, types


def dequantized_reference(model, tensors, types):
    """diffusers holding exactly the weights the GGUF file means."""
    state = {}
    for key, tensor in tensors.items():
        raw = tensor if tensor.dtype == np.uint8 else gguf.quants.quantize(tensor, types[key])
        state[key] = torch.from_numpy(np.array(gguf.quants.dequantize(raw, types[key]), np.float32))
    reference = copy.deepcopy(model)
    reference.load_state_dict(convert_flux2_transformer_checkpoint_to_diffusers(state))
    return reference


@pytest.mark.parametrize("weight_type", [Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda t: t.name)
def test_gguf_equals_dequantised_reference(tiny_transformer, wide, tmp_path, weight_type):
    model, width = (wide, 256) if weight_type.name.endswith("_K") else (tiny_transformer[1], 96)
    tensors, types = gguf_tensors(model, weight_type, np.random.default_rng(0))
    assert weight_type in types.values()
    path = write_gguf(tmp_path / f"flux-2-klein-tiny-{weight_type.name}.gguf", tensors, types)
    ours = load_transformer_file(path)
    variant = variant_of_file(path, ours.cfg)
    assert variant.name.startswith("custom")
    got, want = both_outputs(ours, dequantized_reference(model, tensors, types), width=width)
    assert_close(got, want, TOL)


def test_unsupported_tensor_type(tiny_transformer, tmp_path):
    tensors, types = gguf_tensors(tiny_transformer[1], Q.Q8_0, np.random.default_rng(0))
    types["img_in.weight"] = Q.IQ4_NL
    tensors["img_in.weight"] = np.zeros((32, 128 // 32 * 18), np.uint8)  # IQ4_NL: 18 bytes per 32 values
    path = write_gguf(tmp_path / "t.gguf", tensors, types)
    with pytest.raises(
        CheckpointError, match="tensor 'img_in.weight' has GGUF type IQ4_NL, which klein does not"
    ):
        load_transformer_file(path)


def test_unknown_tensor_type_id(tiny_transformer, tmp_path):
    """A type number the gguf package does not know (a newer format) is a clear error, not a crash."""
    tensors, types = gguf_tensors(tiny_transformer[1], Q.Q8_0, np.random.default_rng(0))
    path = write_gguf(tmp_path / "t.gguf", tensors, types)
    data = bytearray(path.read_bytes())
    # Tensor info: name, then n_dims (u32), the dims (u64 each), then the type (u32).
    name = b"img_in.weight"
    at = data.index(name) + len(name) + 4 + 8 * 2
    assert int.from_bytes(data[at : at + 4], "little") == Q.Q8_0
    data[at : at + 4] = (250).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="not a readable GGUF file .*250"):
        load_transformer_file(path)


torch.set_grad_enabled(False)
