"""Single-file VAEs: BFL's naming (checked against diffusers' own latent-diffusion converter) and diffusers'
naming load the same weights as the diffusers folder; other files are refused."""

import numpy as np
import pytest
import torch
from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint
from flax import nnx

from klein.errors import CheckpointError
from klein.io.bfl_vae_keys import bfl_vae_key
from klein.io.vae_checkpoint import load_vae, load_vae_file
from tests.support.bfl_files import vae_to_bfl, write_safetensors
from tests.support.tiny_vae import build_vae

# FLUX.2's additions to the latent-diffusion names, as diffusers' convert_flux2_to_diffusers.py maps them.
FLUX2_ONLY = {
    "quant_conv.weight": "encoder.quant_conv.weight",
    "quant_conv.bias": "encoder.quant_conv.bias",
    "post_quant_conv.weight": "decoder.post_quant_conv.weight",
    "post_quant_conv.bias": "decoder.post_quant_conv.bias",
    "bn.running_mean": "bn.running_mean",
    "bn.running_var": "bn.running_var",
    "bn.num_batches_tracked": "bn.num_batches_tracked",
}


@pytest.fixture(scope="module")
def vae(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vae")
    return folder / "vae", build_vae(folder)


def test_bfl_names_agree_with_diffusers(vae):
    _, model = vae
    state = model.state_dict()
    bfl = vae_to_bfl(model)
    back = convert_ldm_vae_checkpoint(dict(bfl), dict(model.config))
    assert back.keys() == state.keys() - FLUX2_ONLY.keys()
    for key, tensor in back.items():
        assert torch.equal(tensor.reshape(state[key].shape), state[key]), key
    for key, name in FLUX2_ONLY.items():
        assert bfl_vae_key(key, 4) == name


def flat(model):
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


@pytest.mark.parametrize("naming", ["bfl", "diffusers"])
def test_single_file_equals_folder(vae, tmp_path, naming):
    folder, model = vae
    state = vae_to_bfl(model) if naming == "bfl" else model.state_dict()
    path = write_safetensors(tmp_path / "ae.safetensors", state)
    ours = load_vae_file(path, own=folder)  # its GroupNorm groups and blocks per level
    want = flat(load_vae(folder))
    got = flat(ours)
    assert got.keys() == want.keys()
    for key, value in want.items():
        np.testing.assert_array_equal(got[key], value)


def test_default_config_is_the_real_vae(vae, tmp_path):
    _, model = vae
    path = write_safetensors(tmp_path / "ae.safetensors", vae_to_bfl(model))
    with pytest.raises(CheckpointError, match="with norm_num_groups=32"):
        load_vae_file(path)  # the tiny file's widths under the released FLUX.2 VAE's config


def test_transformer_passed_as_vae(tiny_transformer, tmp_path):
    folder, _ = tiny_transformer
    with pytest.raises(CheckpointError, match="not a FLUX.2 VAE"):
        load_vae_file(folder / "transformer" / "diffusion_pytorch_model.safetensors")
