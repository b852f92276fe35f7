"""Strict transformer loading: sharded and bf16 checkpoints, real configs on the meta device, and
clear errors for every kind of broken checkpoint."""

import copy
import json

import accelerate
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import Flux2Transformer2DModel
from flax import nnx
from safetensors.numpy import save_file
from safetensors.torch import load_file

from klein.errors import CheckpointError
from klein.io.transformer_checkpoint import expected_transformer_keys, load_transformer
from klein.models.stacks import as_float
from klein.models.transformer_config import KLEIN_4B, KLEIN_9B, TransformerConfig

# The transformer configs of the published checkpoints (black-forest-labs/FLUX.2-klein-*/transformer).
REAL_CONFIGS = {
    "klein-4b": dict(num_layers=5, num_single_layers=20, num_attention_heads=24, joint_attention_dim=7680),
    "klein-9b": dict(num_layers=8, num_single_layers=24, num_attention_heads=32, joint_attention_dim=12288),
}
REAL_CONFIGS["klein-9b-kv"] = REAL_CONFIGS["klein-9b"]  # same architecture, other weights
COMMON = dict(
    patch_size=1,
    in_channels=128,
    attention_head_dim=128,
    timestep_guidance_channels=256,
    mlp_ratio=3.0,
    axes_dims_rope=(32, 32, 32, 32),
    rope_theta=2000,
    eps=1e-6,
    guidance_embeds=False,
)


def _flat(model):
    return {p: as_float(np.asarray(v.get_value())) for p, v in nnx.to_flat_state(nnx.state(model))}


@pytest.mark.parametrize(
    "name,registered", [("klein-4b", KLEIN_4B), ("klein-9b", KLEIN_9B), ("klein-9b-kv", KLEIN_9B)]
)
def test_real_configs_match_diffusers_keys_and_shapes(name, registered):
    config = {**COMMON, **REAL_CONFIGS[name]}
    assert TransformerConfig.from_diffusers(config) == registered
    with accelerate.init_empty_weights():
        reference = Flux2Transformer2DModel(**config)
    want = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    assert expected_transformer_keys(registered) == want
    params = sum(int(np.prod(s)) for s in want.values())
    assert abs(params / 1e9 - {"klein-4b": 3.88, "klein-9b": 9.08, "klein-9b-kv": 9.08}[name]) < 0.01


def test_sharded_equals_single_file(tiny_transformer, tmp_path):
    folder, reference = tiny_transformer
    reference.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    single = _flat(load_transformer(folder / "transformer"))
    sharded = _flat(load_transformer(tmp_path / "sharded"))
    assert single.keys() == sharded.keys()
    for key in single:
        np.testing.assert_array_equal(single[key], sharded[key])


def test_bf16_checkpoint_loads_as_bf16_and_fp32(tiny_transformer, tmp_path):
    folder, reference = tiny_transformer
    # A copy: casting the session's shared model in place would round it for every later test.
    copy.deepcopy(reference).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    as_bf16 = _flat(load_transformer(tmp_path / "bf16", dtype=jnp.bfloat16))
    as_fp32 = _flat(load_transformer(tmp_path / "bf16", dtype=jnp.float32))
    exact = _flat(load_transformer(folder / "transformer"))
    for key, value in as_bf16.items():
        assert value.dtype == jnp.bfloat16 and as_fp32[key].dtype == np.float32
        np.testing.assert_array_equal(value.astype(np.float32), as_fp32[key])
        np.testing.assert_allclose(as_fp32[key], exact[key], rtol=1e-2, atol=1e-6)


@pytest.fixture
def broken(tiny_transformer, tmp_path):
    """A writable copy of the tiny checkpoint, sharded, to break in various ways."""
    _, reference = tiny_transformer
    reference.save_pretrained(tmp_path / "t", max_shard_size="100KB")
    return tmp_path / "t"


def shards(folder):
    index = json.loads((folder / "diffusion_pytorch_model.safetensors.index.json").read_text())
    return index, sorted(set(index["weight_map"].values()))


def test_missing_shard_is_named(broken):
    _, files = shards(broken)
    (broken / files[1]).unlink()
    with pytest.raises(CheckpointError, match=f"shard {files[1]} is missing"):
        load_transformer(broken)


def test_truncated_shard_is_named(broken):
    _, files = shards(broken)
    data = (broken / files[0]).read_bytes()
    (broken / files[0]).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=f"{files[0]}: not a readable safetensors file"):
        load_transformer(broken)


def test_not_a_safetensors_file(broken):
    _, files = shards(broken)
    (broken / files[0]).write_text("<html>rate limited</html>")
    with pytest.raises(CheckpointError, match=f"{files[0]}: not a readable safetensors file"):
        load_transformer(broken)


def rewrite(folder, edit):
    """Apply edit(dict of tensors) to the shard holding proj_out.weight and save it back."""
    index, _ = shards(folder)
    name = index["weight_map"]["proj_out.weight"]
    tensors = {k: v.numpy() for k, v in load_file(folder / name).items()}
    edit(tensors)
    save_file(tensors, folder / name)
    kept = {k: v for k, v in index["weight_map"].items() if v != name}
    index["weight_map"] = kept | {k: name for k in tensors}
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))


def test_missing_key_is_named(broken):
    rewrite(broken, lambda t: t.pop("proj_out.weight"))
    with pytest.raises(CheckpointError, match="1 missing key: proj_out.weight"):
        load_transformer(broken)


def test_unexpected_key_is_named(broken):
    rewrite(broken, lambda t: t.update({"proj_out.bias": np.zeros(128, np.float32)}))
    with pytest.raises(CheckpointError, match="1 unexpected key: proj_out.bias"):
        load_transformer(broken)


def test_wrong_shape_is_named(broken):
    rewrite(broken, lambda t: t.update({"proj_out.weight": np.zeros((128, 16), np.float32)}))
    with pytest.raises(CheckpointError, match=r"tensor 'proj_out.weight' has shape \(128, 16\)"):
        load_transformer(broken)


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="cannot read transformer config"):
        load_transformer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**COMMON, **REAL_CONFIGS["klein-4b"]}))
    with pytest.raises(CheckpointError, match="found neither diffusion_pytorch_model.safetensors"):
        load_transformer(tmp_path)


def test_flux2_dev_config_is_rejected():
    with pytest.raises(CheckpointError, match="guidance_embeds"):
        TransformerConfig.from_diffusers({**COMMON, "guidance_embeds": True, "num_layers": 8})


def test_a_config_without_single_blocks_is_refused_by_name():
    """diffusers builds one; klein's last single block is a step of its own, so it refuses it at load."""
    blocks = {**COMMON, **REAL_CONFIGS["klein-4b"]}
    assert TransformerConfig.from_diffusers({**blocks, "num_single_layers": 1}).num_single_layers == 1
    with pytest.raises(CheckpointError, match="0 single blocks; klein runs transformers with at least one"):
        TransformerConfig.from_diffusers({**blocks, "num_single_layers": 0})
