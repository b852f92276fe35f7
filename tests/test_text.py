"""Prompt preparation: token ids, masks and position ids equal transformers' / diffusers' exactly."""

import json
import shutil

import numpy as np
import pytest
import torch
from diffusers import Flux2KleinPipeline

from klein.errors import CheckpointError, InputError
from klein.pipeline.prompts import load_tokenizer, render_prompt, token_count, tokenize_prompts
from klein.sampling import text_ids
from tests.support.tiny_text_encoder import build_tokenizer, hf_chat_tokens

PROMPTS = [
    "",
    "A red fox in fresh snow at dawn.",
    "Ünïcödé 東京 🐱",
    "two\n\nlines\twith  spaces ",
    "<|im_end|> special-token text <think>",
    "a lighthouse in a storm, " * 120,  # beyond 512 tokens: truncated
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(tokenizer folder, the transformers tokenizer loaded from it)."""
    folder = tmp_path_factory.mktemp("tiny-tokenizer")
    return folder / "tokenizer", build_tokenizer(folder)


def test_ids_and_mask_equal_transformers(tiny):
    folder, hf = tiny
    ours = load_tokenizer(folder)
    texts, ref_ids, ref_mask = hf_chat_tokens(hf, PROMPTS)
    assert [render_prompt(ours, p) for p in PROMPTS] == texts
    assert (
        texts[1]
        == "<|im_start|>user\nA red fox in fresh snow at dawn.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    ids, mask = tokenize_prompts(ours, PROMPTS)
    assert ids.dtype == mask.dtype == np.int32 and ids.shape == mask.shape == (len(PROMPTS), 512)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_array_equal(mask, ref_mask)
    assert mask[-1].all() and not mask[0].all()


def test_token_count_is_the_untruncated_length_and_tokenizing_still_truncates(tiny):
    folder, hf = tiny
    ours = load_tokenizer(folder)
    texts, _, _ = hf_chat_tokens(hf, PROMPTS)
    counts = [token_count(ours, prompt) for prompt in PROMPTS]
    assert counts == [len(hf(text)["input_ids"]) for text in texts]
    assert counts[-1] > 512 and max(counts[:-1]) < 512
    ids, mask = tokenize_prompts(ours, PROMPTS)  # after counting, as the pipeline runs them
    assert ids.shape == (len(PROMPTS), 512) and mask[-1].all()


def test_short_limit_and_single_string(tiny):
    folder, hf = tiny
    _, ref_ids, ref_mask = hf_chat_tokens(hf, [PROMPTS[2]], max_length=16)
    ids, mask = tokenize_prompts(load_tokenizer(folder), PROMPTS[2], max_length=16)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_array_equal(mask, ref_mask)


def test_template_from_tokenizer_config_and_left_padding(tiny, tmp_path):
    # Older checkpoints keep the template in tokenizer_config.json; a padding_side there is honoured.
    folder, _ = tiny
    moved = tmp_path / "tokenizer"
    shutil.copytree(folder, moved)
    config = json.loads((moved / "tokenizer_config.json").read_text())
    config["chat_template"] = (moved / "chat_template.jinja").read_text()
    config["padding_side"] = "left"
    (moved / "tokenizer_config.json").write_text(json.dumps(config))
    (moved / "chat_template.jinja").unlink()
    from transformers import Qwen2TokenizerFast

    _, ref_ids, ref_mask = hf_chat_tokens(Qwen2TokenizerFast.from_pretrained(moved), PROMPTS)
    ids, mask = tokenize_prompts(load_tokenizer(moved), PROMPTS)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_array_equal(mask, ref_mask)
    assert mask[0, -1] == 1 and mask[0, 0] == 0


def test_text_position_ids_equal_diffusers():
    ref = Flux2KleinPipeline._prepare_text_ids(torch.zeros(2, 512, 96))
    np.testing.assert_array_equal(np.broadcast_to(text_ids(512), (2, 512, 4)), ref.numpy())


@pytest.mark.parametrize("prompt", [None, 3, ["ok", 1], [], b"bytes"])
def test_non_string_prompts_are_input_errors(tiny, prompt):
    with pytest.raises(InputError):
        tokenize_prompts(load_tokenizer(tiny[0]), prompt)


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda f: (f / "tokenizer.json").unlink(), "tokenizer.json"),
        (lambda f: (f / "tokenizer.json").write_text("{not json"), "tokenizer.json"),
        (lambda f: (f / "tokenizer_config.json").unlink(), "tokenizer_config.json"),
        (lambda f: (f / "chat_template.jinja").unlink(), "no chat template"),
        (lambda f: (f / "chat_template.jinja").write_text("{% if %}"), "does not compile"),
    ],
)
def test_broken_tokenizer_folders_are_checkpoint_errors(tiny, tmp_path, damage, words):
    folder = tmp_path / "tokenizer"
    shutil.copytree(tiny[0], folder)
    damage(folder)
    with pytest.raises(CheckpointError, match=words):
        load_tokenizer(folder)
