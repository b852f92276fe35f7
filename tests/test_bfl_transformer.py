"""BFL single-file transformers: the key map against diffusers' own converter, parity of a file written in
BFL naming, variant detection (real 4b / 9b layouts from the meta device), and clear errors."""

import collections
from pathlib import Path

import accelerate
import pytest
import torch
from diffusers import Flux2Transformer2DModel
from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

from klein.errors import CheckpointError
from klein.io.bfl_transformer_keys import bfl_key, bfl_layout, config_from_bfl
from klein.io.transformer_checkpoint import expected_transformer_keys
from klein.io.transformer_file import file_config, load_transformer_file
from klein.models.transformer_config import KLEIN_4B, KLEIN_9B, TransformerConfig
from klein.models.variants import VARIANTS
from klein.pipeline.checkpoints import variant_of_file
from tests.support.bfl_files import to_bfl, write_safetensors
from tests.support.compare import assert_close
from tests.support.single_file_cases import both_outputs
from tests.support.tiny_transformer import TINY_TRANSFORMER
from tests.support.tiny_vae import build_vae
from tests.test_transformer_loading import COMMON, REAL_CONFIGS

TOL = 1e-5  # fp32 on both sides, the same weights: only summation order differs


@pytest.fixture(scope="module")
def bfl_state(tiny_transformer):
    return to_bfl(tiny_transformer[1].state_dict())


@pytest.mark.parametrize("cfg", [KLEIN_4B, KLEIN_9B, TransformerConfig.from_diffusers(TINY_TRANSFORMER)])
def test_reverse_map_covers_every_key_exactly_once(cfg):
    """Each diffusers key has one BFL source, and each BFL tensor's row blocks are used once each."""
    sources = [bfl_key(key) for key in expected_transformer_keys(cfg)]
    blocks = collections.defaultdict(list)
    for source in sources:
        blocks[source.key].append((source.block, source.blocks))
    for key, used in blocks.items():
        count = used[0][1]
        assert sorted(used) == [(i, count) for i in range(count)], key
    assert sum(len(used) for used in blocks.values()) == len(sources)


def test_map_agrees_with_diffusers_converter(tiny_transformer, bfl_state):
    """diffusers' BFL -> diffusers conversion undoes our diffusers -> BFL map exactly."""
    state = tiny_transformer[1].state_dict()
    back = convert_flux2_transformer_checkpoint_to_diffusers(dict(bfl_state))
    assert back.keys() == state.keys()
    for key, tensor in state.items():
        assert torch.equal(back[key], tensor), key


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_bfl_file_equals_diffusers(tiny_transformer, bfl_state, tmp_path, prefix):
    path = write_safetensors(tmp_path / "tiny.safetensors", {prefix + k: v for k, v in bfl_state.items()})
    ours = load_transformer_file(path)
    variant = variant_of_file(path, ours.cfg)
    assert variant.name == "custom (tiny.safetensors)" and not variant.kv
    got, want = both_outputs(ours, tiny_transformer[1])
    assert_close(got, want, TOL)


@pytest.mark.parametrize("name,registered", [("klein-4b", KLEIN_4B), ("klein-9b", KLEIN_9B)])
def test_real_layouts_are_recognised(name, registered):
    """The BFL layout of the real models (from diffusers on the meta device, through the reverse map) gives
    back the registered config, and file names then give the variant."""
    with accelerate.init_empty_weights():
        reference = Flux2Transformer2DModel(**COMMON, **REAL_CONFIGS[name])
    layout = bfl_layout({k: tuple(v.shape) for k, v in reference.state_dict().items()})
    assert "double_blocks.0.img_attn.qkv.weight" in layout
    assert config_from_bfl(layout, "real") == registered
    size = name.removeprefix("klein-")
    for file, variant in [
        (f"flux-2-klein-{size}.safetensors", f"klein-{size}"),
        (f"flux-2-klein-base-{size}-fp8.safetensors", f"klein-base-{size}"),
        (f"flux-2-klein-{size}-Q4_K_M.gguf", f"klein-{size}"),
    ]:
        assert variant_of_file(Path(file), registered) == VARIANTS[variant]
    if size == "9b":
        assert (
            variant_of_file(Path("flux-2-klein-9b-kv-fp8.safetensors"), registered) == VARIANTS["klein-9b-kv"]
        )
        assert variant_of_file(Path("renamed.safetensors"), registered, "klein-9b-kv").kv
    else:
        with pytest.raises(CheckpointError, match=r"holds a klein-4b transformer .* not klein-9b"):
            variant_of_file(Path("renamed.safetensors"), registered, "klein-9b")


def test_tiny_file_forced_as_9b_is_refused(bfl_state, tmp_path):
    path = write_safetensors(tmp_path / "flux-2-klein-9b.safetensors", bfl_state)
    assert variant_of_file(Path("tiny-kv.gguf"), TransformerConfig.from_diffusers(TINY_TRANSFORMER)).kv
    with pytest.raises(CheckpointError, match="holds a non-standard transformer .* not klein-9b"):
        variant_of_file(path, file_config(path), "klein-9b")


def test_vae_passed_as_transformer(tmp_path):
    build_vae(tmp_path)
    with pytest.raises(CheckpointError, match="not a FLUX.2 .klein. transformer: it holds autoencoder"):
        load_transformer_file(tmp_path / "vae" / "diffusion_pytorch_model.safetensors")


def test_missing_and_extra_tensors_are_named_in_bfl_terms(bfl_state, tmp_path):
    broken = dict(bfl_state)
    broken.pop("double_blocks.1.txt_attn.qkv.weight")
    broken["final_layer.linear.bias"] = torch.zeros(128)
    with pytest.raises(CheckpointError, match="missing: double_blocks.1.txt_attn.qkv.weight") as error:
        load_transformer_file(write_safetensors(tmp_path / "t.safetensors", broken))
    assert "unexpected: final_layer.linear.bias" in str(error.value)


def test_flux2_dev_is_refused(bfl_state, tmp_path):
    dev = {**bfl_state, "guidance_in.in_layer.weight": torch.zeros(32, 256)}
    with pytest.raises(CheckpointError, match=r"FLUX.2 \[dev\]"):
        load_transformer_file(write_safetensors(tmp_path / "dev.safetensors", dev))


torch.set_grad_enabled(False)
