"""A text encoder folder's Linears quantised at load into ggml blocks (`load_pipeline(...,
text_encoder_weights="Q8_0" | "Q4_0")`), its token table kept in host memory: its prompt embeddings equal,
to the bit, those of a GGUF file holding the same blocks (`gguf`'s quantiser, llama.cpp's definition), and
the pipeline's device weights hold the blocks, not the table."""

import jax
import numpy as np
import pytest
from flax import nnx

from klein.io.text_encoder_checkpoint import TABLE, load_text_encoder, read_table
from klein.io.text_encoder_gguf import load_text_encoder_gguf
from klein.models import stacks
from klein.models.qwen3 import prompt_embeddings
from klein.pipeline.prompts import load_tokenizer, tokenize_prompts
from tests.support.qwen3_gguf import T, write_qwen3_gguf
from tests.support.tiny_text_encoder import build_text_encoder, build_tokenizer

PROMPTS = ["A red fox in fresh snow at dawn.", "the cat wears the hat"]
TOKENS = 64
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_embeddings = nnx.jit(prompt_embeddings)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3-folder")
    build_tokenizer(folder)
    build_text_encoder(folder)
    return folder


@pytest.fixture(scope="module")
def ids(tiny):
    return tokenize_prompts(load_tokenizer(tiny / "tokenizer"), PROMPTS, TOKENS)


def as_gguf(tiny, tmp_path_factory, blocks: str):
    """The tiny encoder as a GGUF whose decoder Linears are `blocks`, every other tensor F32."""
    path = tmp_path_factory.mktemp(f"qwen3-{blocks}") / f"Qwen3-tiny-{blocks}.gguf"
    return write_qwen3_gguf(path, tiny, dict.fromkeys(LINEARS, T[blocks]))


@pytest.mark.parametrize("blocks", ["Q8_0", "Q4_0"])
def test_blocks_at_load_equal_a_gguf_of_them(tiny, ids, blocks, tmp_path_factory):
    folder = tiny / "text_encoder"
    encoder = load_text_encoder(folder, blocks=blocks)
    assert encoder.model.embed_tokens is None  # the table is not on the device
    table = read_table(folder, np.float32)
    ours = np.asarray(_embeddings(encoder, table[np.asarray(ids[0])], ids[1]))
    theirs = np.asarray(_embeddings(load_text_encoder_gguf(as_gguf(tiny, tmp_path_factory, blocks)), *ids))
    np.testing.assert_array_equal(ours, theirs)
    # ... and the blocks are what quantised them: the full-precision encoder's embeddings differ.
    exact = np.asarray(_embeddings(load_text_encoder(folder), *ids))
    assert not np.array_equal(ours, exact)
    error = np.linalg.norm(ours - exact) / np.linalg.norm(exact)
    assert error < {"Q8_0": 0.05, "Q4_0": 0.5}[blocks], error  # the tiny model: a bound, not a figure


def test_table_rows_gathered_on_the_host_equal_the_programs(tiny, ids):
    folder = tiny / "text_encoder"
    table = read_table(folder, np.float32)
    whole = load_text_encoder(folder)
    rows = jax.jit(stacks.rows)(whole.model.embed_tokens.embedding[...], ids[0])
    np.testing.assert_array_equal(np.asarray(rows), table[np.asarray(ids[0])])
    assert TABLE == "model.embed_tokens.weight"


def test_widths_off_the_blocks_are_refused_by_name():
    """A Linear whose inputs do not fill whole blocks of 32 cannot be ggml blocks: the flag and the widths
    are named, before anything is read (real Qwen3 widths all fill them)."""
    from klein.errors import InputError
    from klein.io.text_encoder_checkpoint import quantised_forms
    from klein.models.qwen3_config import Qwen3Config

    def config(hidden, intermediate):
        return Qwen3Config(
            vocab_size=64, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=28,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e6, rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        )  # fmt: skip

    assert len(quantised_forms(config(64, 96), "Q4_0")) == len(LINEARS)
    with pytest.raises(
        InputError, match=r"--text-encoder-weights Q8_0: .* take 48, 80; use --text-encoder-weights dtype"
    ):
        quantised_forms(config(48, 80), "Q8_0")
