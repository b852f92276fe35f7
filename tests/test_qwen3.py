"""Qwen3 text encoder: parity with transformers and diffusers on a tiny random model, real-config loading."""

import copy
import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
from diffusers import Flux2KleinPipeline
from flax import nnx
from safetensors.numpy import load_file, save_file

from klein.cli import main as cli
from klein.errors import CheckpointError
from klein.io import demo
from klein.io.loading import expected_shapes
from klein.io.text_encoder_checkpoint import STACKED, abstract_text_encoder, load_text_encoder, skipped_keys
from klein.models.qwen3 import hidden_states, prompt_embeddings
from klein.models.qwen3_config import Qwen3Config
from klein.pipeline.loading import load_pipeline
from klein.pipeline.prompts import load_tokenizer, tokenize_prompts
from tests.support.compare import max_abs
from tests.support.tiny_text_encoder import build_text_encoder, build_tokenizer, hf_chat_tokens

LAYERS = (9, 18, 27)
TOL = dict(rtol=1e-4, atol=1e-4)
PROMPTS = ["A red fox in fresh snow at dawn.", "Ünïcödé 東京 🐱"]
# jit over the module: one compilation per input shape instead of op-by-op dispatch.
_hidden_states = nnx.jit(hidden_states, static_argnames="layers")
_prompt_embeddings = nnx.jit(prompt_embeddings, static_argnames="layers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(folder, transformers model, transformers tokenizer) of a tiny checkpoint in the diffusers layout."""
    folder = tmp_path_factory.mktemp("tiny-text-encoder")
    tokenizer = build_tokenizer(folder)
    return folder, build_text_encoder(folder), tokenizer


@pytest.fixture(scope="module")
def encoder(tiny):
    return load_text_encoder(tiny[0] / "text_encoder")


def reference_hidden_states(model, ids, mask, layers=LAYERS) -> np.ndarray:
    with torch.no_grad():
        out = model(
            input_ids=torch.as_tensor(ids, dtype=torch.long),
            attention_mask=torch.as_tensor(mask, dtype=torch.long),
            output_hidden_states=True,
            use_cache=False,
        )
    return np.stack([out.hidden_states[k].numpy() for k in layers])


def hf_tokens(tokenizer, prompts, max_length):
    return hf_chat_tokens(tokenizer, prompts, max_length)[1:]


def prompt_of_length(tokenizer, n_tokens: int) -> str:
    """A prompt whose chat-formatted text is exactly `n_tokens` tokens long."""
    template_only = hf_tokens(tokenizer, [""], 10_000)[1].sum()
    # Qwen's pre-tokenizer splits digits one by one, so each adds exactly one token.
    prompt = "7" * (n_tokens - template_only)
    assert hf_tokens(tokenizer, [prompt], 10_000)[1].sum() == n_tokens
    return prompt


def test_hidden_states_match_transformers_at_512(tiny, encoder):
    _, model, tokenizer = tiny
    ids, mask = hf_tokens(tokenizer, PROMPTS, 512)
    ours = np.asarray(_hidden_states(encoder, ids, mask, LAYERS))
    ref = reference_hidden_states(model, ids, mask)
    assert ours.shape == (3, 2, 512, 32)
    # Pad rows too: the transformer attends over all 512 text tokens.
    np.testing.assert_allclose(ours, ref, **TOL)


@pytest.mark.parametrize("case", ["shorter", "equal", "longer"])
def test_hidden_states_match_transformers_around_the_limit(tiny, encoder, case):
    _, model, tokenizer = tiny
    limit = 32
    prompt = {"shorter": "fox", "equal": None, "longer": "a cat in the snow " * 8}[case]
    prompt = prompt_of_length(tokenizer, limit) if prompt is None else prompt
    ids, mask = hf_tokens(tokenizer, [prompt], limit)
    assert (mask.sum() < limit) == (case == "shorter")
    ours = np.asarray(_hidden_states(encoder, ids, mask, LAYERS))
    np.testing.assert_allclose(ours, reference_hidden_states(model, ids, mask), **TOL)


def test_rows_with_no_visible_key_match_transformers(tiny, encoder):
    # Left padding leaves queries that may attend to nothing; SDPA gives them 0, and so must we.
    _, model, _ = tiny
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 24))
    mask = np.ones((2, 24), np.int64)
    mask[0, :5] = 0
    mask[1, 20:] = 0
    layers = (1, 9, 27)
    ours = np.asarray(_hidden_states(encoder, ids, mask, layers))
    np.testing.assert_allclose(ours, reference_hidden_states(model, ids, mask, layers), **TOL)


def test_prompt_embeddings_match_diffusers(tiny, encoder):
    folder, model, tokenizer = tiny
    with torch.no_grad():
        ref = Flux2KleinPipeline._get_qwen3_prompt_embeds(
            text_encoder=model, tokenizer=tokenizer, prompt=PROMPTS
        )
    ids, mask = tokenize_prompts(load_tokenizer(folder / "tokenizer"), PROMPTS)
    ours = np.asarray(_prompt_embeddings(encoder, ids, mask))
    assert ours.shape == tuple(ref.shape) == (2, 512, 96)
    np.testing.assert_allclose(ours, ref.numpy(), **TOL)


def test_embedding_is_sensitive_to_prompt_and_weights(tiny, encoder):
    _, model, tokenizer = tiny
    ids, mask = hf_tokens(tokenizer, PROMPTS, 32)
    ours = np.asarray(_prompt_embeddings(encoder, ids, mask))
    # The chat template is a shared prefix; compare where the prompts differ.
    relative = np.abs(ours[0] - ours[1]).mean() / np.abs(ours[0]).mean()
    assert relative > 0.05
    perturbed = copy.deepcopy(model)
    with torch.no_grad():
        perturbed.model.layers[4].self_attn.k_norm.weight.mul_(1.02)
    ref = reference_hidden_states(perturbed, ids, mask)
    assert max_abs(_hidden_states(encoder, ids, mask, LAYERS), ref) > 100 * TOL["atol"]


# The real text encoders, as config.json files on the hub write them (transformers 4.51).
REAL_CONFIGS = {
    "qwen3_4b": dict(hidden_size=2560, intermediate_size=9728, tie_word_embeddings=True),
    "qwen3_8b": dict(hidden_size=4096, intermediate_size=12288, tie_word_embeddings=False),
}


def real_hf_config(name: str) -> dict:
    return dict(
        architectures=["Qwen3ForCausalLM"],
        attention_bias=False,
        attention_dropout=0.0,
        bos_token_id=151643,
        eos_token_id=151645,
        head_dim=128,
        hidden_act="silu",
        max_position_embeddings=40960,
        max_window_layers=36,
        model_type="qwen3",
        num_attention_heads=32,
        num_hidden_layers=36,
        num_key_value_heads=8,
        rms_norm_eps=1e-06,
        rope_scaling=None,
        rope_theta=1000000,
        sliding_window=None,
        torch_dtype="bfloat16",
        use_cache=True,
        use_sliding_window=False,
        vocab_size=151936,
        **REAL_CONFIGS[name],
    )


@pytest.mark.parametrize("name", sorted(REAL_CONFIGS))
def test_real_configs_load_without_weights(name):
    from accelerate import init_empty_weights
    from transformers import Qwen3Config as HFQwen3Config
    from transformers import Qwen3ForCausalLM

    legacy = real_hf_config(name)
    hf_config = HFQwen3Config(**legacy)
    config = getattr(Qwen3Config, name)()
    assert Qwen3Config.from_hf_config(legacy) == config
    assert Qwen3Config.from_hf_config(hf_config.to_dict()) == config  # transformers 5 `rope_parameters`
    with init_empty_weights():
        model = Qwen3ForCausalLM(hf_config)
    theirs = {key: tuple(t.shape) for key, t in model.state_dict().items()}
    ours = expected_shapes(abstract_text_encoder(config, max(LAYERS)), stacked=STACKED)
    skipped = skipped_keys(config, max(LAYERS))
    assert {key: theirs.get(key) for key in ours} == ours
    assert set(theirs) - set(ours) == skipped
    assert len(ours) == 1 + 27 * 11 and len(skipped) == 9 * 11 + 2


def test_bad_checkpoints_are_reported_by_key(tiny, tmp_path):
    folder = tmp_path / "text_encoder"
    shutil.copytree(tiny[0] / "text_encoder", folder)
    weights = load_file(folder / "model.safetensors")

    def expect_error(tensors, *words):
        save_file(tensors, folder / "model.safetensors")
        with pytest.raises(CheckpointError) as info:
            load_text_encoder(folder)
        assert all(word in str(info.value) for word in words), info.value

    missing = dict(weights)
    del missing["model.layers.3.mlp.up_proj.weight"]
    expect_error(missing, "missing", "model.layers.3.mlp.up_proj.weight")
    stray = np.zeros(3, np.float32)
    expect_error({**weights, "model.layers.27.mlp.bias": stray}, "unexpected", "model.layers.27.mlp.bias")
    expect_error({**weights, "model.layers.40.mlp.up_proj.weight": stray}, "model.layers.40.mlp.up_proj")
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}
    (folder / "config.json").write_text(json.dumps(config))
    expect_error(weights, "rope_type='yarn'")


@pytest.mark.parametrize("layers", [4, 27])
def test_an_encoder_without_the_layers_read_is_refused_before_its_weights(tmp_path, capsys, layers):
    """A Qwen3 with fewer decoder layers than the prompt embedding reads (diffusers' pipeline fails on it
    mid-request with an IndexError), or with exactly 27 (transformers' hidden state after the last layer is
    the final norm's output, which diffusers would read as layer 27): the pipeline and `klein plan` refuse
    it, naming the layers, before any weight is read."""
    spec = dataclasses.replace(demo.DEMO, text_encoder=demo.text_encoder_config(32, 64, layers, 4, 2, 8))
    demo.write_checkpoint(tmp_path, spec)
    (tmp_path / "text_encoder" / "model.safetensors").write_bytes(b"")  # never read
    message = (
        f"has {layers} decoder layers; the prompt embedding reads the hidden states after layers 9, 18, 27"
    )
    with pytest.raises(CheckpointError, match=message):
        load_pipeline(str(tmp_path))
    assert cli.main(["plan", "--model", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
