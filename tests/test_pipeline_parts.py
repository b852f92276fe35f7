"""A pipeline built from parts (a BFL transformer file, the text encoder, VAE and tokenizer kept apart), through
`load_pipeline` and through `klein generate --transformer ...`; parity with diffusers on the same weights."""

import json

import PIL.Image
import pytest

from klein.cli import main as cli
from klein.errors import InputError
from klein.pipeline.loading import load_pipeline
from tests.support.bfl_files import to_bfl, write_safetensors
from tests.test_pipeline import compare


@pytest.fixture(scope="module")
def parts(tiny_pipelines, tmp_path_factory):
    """(pipeline folder, diffusers pipeline, BFL transformer file of the same weights)."""
    folder, reference = tiny_pipelines("distilled")
    file = tmp_path_factory.mktemp("parts") / "flux-2-klein-tiny.safetensors"
    return folder, reference, write_safetensors(file, to_bfl(reference.transformer.state_dict()))


def test_parts_equal_diffusers(parts):
    folder, reference, file = parts
    # The text encoder named by its pipeline folder: its text_encoder/ part, and the tokenizer beside it.
    pipe = load_pipeline(transformer=file, text_encoder=folder, vae=folder / "vae")
    assert pipe.name == str(file) and pipe.variant.name == "custom (flux-2-klein-tiny.safetensors)"
    compare(pipe, reference, "a red fox", 1, 32, 48, height=32, width=48, num_inference_steps=2)


def test_missing_parts_are_named(parts):
    _, _, file = parts
    with pytest.raises(InputError, match="no model to take the text_encoder, vae from"):
        load_pipeline(transformer=file)


def test_cli_transformer_file(parts, tmp_path):
    folder, _, file = parts
    out = tmp_path / "fox.png"
    args = ["--transformer", file, "--text-encoder", folder / "text_encoder", "--vae", folder / "vae"]
    args += ["--tokenizer", folder / "tokenizer", "--prompt", "a fox", "--steps", "1", "--height", "32"]
    assert cli.main(["generate", *map(str, args), "--width", "48", "--out", str(out)]) == 0
    image = PIL.Image.open(out)
    assert image.size == (48, 32) and image.text["model"] == str(file)
    assert json.loads(image.text["image"]) == []
