"""Abstract models built from `AbstractKeys` (`klein.models.abstract_keys`) are the ones `nnx.Rngs` builds:
the same module graph, every parameter of the same shape and dtype, the stacks included."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from klein.io import demo
from klein.models.abstract_keys import AbstractKeys
from klein.models.qwen3 import Qwen3TextEncoder
from klein.models.qwen3_config import Qwen3Config
from klein.models.taef2 import TAEF2Decoder
from klein.models.transformer import Flux2Transformer
from klein.models.transformer_config import TransformerConfig
from klein.models.vae import AutoencoderKLFlux2, VAEConfig

BUILDS = {
    "vae": lambda keys: AutoencoderKLFlux2(VAEConfig.from_diffusers_config(demo.DEMO.vae), rngs=keys),
    "transformer": lambda keys: Flux2Transformer(
        TransformerConfig.from_diffusers(demo.DEMO.transformer), rngs=keys, dtype=jnp.bfloat16
    ),
    "text encoder": lambda keys: Qwen3TextEncoder(
        Qwen3Config.from_hf_config(dict(demo.DEMO.text_encoder, vocab_size=320)),
        3,
        rngs=keys,
        dtype=jnp.float32,
    ),
    "taef2": lambda keys: TAEF2Decoder(32, rngs=keys),
}


def shapes(state):
    return jax.tree.map(lambda x: (x.shape, x.dtype), state)


@pytest.mark.parametrize("model", list(BUILDS))
def test_an_abstract_model_is_the_same_from_either_keys(model):
    want_graph, want = nnx.split(nnx.eval_shape(lambda: BUILDS[model](nnx.Rngs(0))))
    got_graph, got = nnx.split(nnx.eval_shape(lambda: BUILDS[model](AbstractKeys())))
    assert got_graph == want_graph
    assert shapes(got) == shapes(want) and len(jax.tree.leaves(got)) > 10
