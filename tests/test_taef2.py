"""TAEF2's decoder in JAX equals the reference architecture (`tests/support/taef2_reference.py`) on random
weights saved in each published layout; files that are not TAEF2's decoder are refused naming what they
are and what to use."""

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from klein.errors import CheckpointError, InputError
from klein.io import taef2_checkpoint
from klein.io.taef2_checkpoint import load_taef2
from klein.pipeline.preview import Previewer
from tests.support.taef2_reference import reference_decoder, reference_frames, save_reference


@pytest.fixture(scope="module")
def reference():
    """The reference decoder, its weights rounded to the fp16 the files hold."""
    return reference_decoder().half().float()


def packed_latents(batch: int, h: int, w: int, seed: int = 0) -> np.ndarray:
    """float32[batch, h * w, 128] normalised latents as the step callback sees them, wide enough (std 2)
    that the decoder's soft clamp matters."""
    return 2 * np.random.default_rng(seed).standard_normal((batch, h * w, 128)).astype(np.float32)


@pytest.mark.parametrize("layout", ["decoder", "module", "diffusers"])
def test_the_decoder_equals_the_reference_in_each_published_layout(reference, tmp_path, layout):
    path = tmp_path / f"taef2-{layout}.safetensors"
    save_reference(reference, path, layout)
    previewer = Previewer(load_taef2(path, latent_channels=32))
    latents = packed_latents(2, 3, 5)
    expected = reference_frames(reference, latents, 3, 5)
    got = previewer.pixels(latents, (3, 5))
    assert got.shape == (2, 48, 80, 3) and expected.std() > 0.01
    np.testing.assert_allclose(got, expected.clip(0, 1), atol=2e-5)


def test_a_missing_file_says_what_to_download_and_where(tmp_path):
    with pytest.raises(InputError) as caught:
        load_taef2(tmp_path / "nothing.safetensors")
    message = str(caught.value)
    assert "nothing.safetensors does not exist" in message
    assert taef2_checkpoint.DOWNLOAD in message and str(taef2_checkpoint.default_path()) in message


def test_other_files_are_refused_naming_what_they_are(reference, tmp_path):
    taesd = {k: v for k, v in reference.state_dict().items() if ".pool." not in k}
    save_file(taesd, str(tmp_path / "taef1.safetensors"))
    with pytest.raises(CheckpointError, match="without TAEF2's GroupNorm branch .*TAESD or TAEF1"):
        load_taef2(tmp_path / "taef1.safetensors")
    save_file({"decoder.conv_in.weight": torch.zeros(4, 4)}, str(tmp_path / "vae.safetensors"))
    with pytest.raises(CheckpointError, match="not a TAEF2 decoder"):
        load_taef2(tmp_path / "vae.safetensors")
    save_reference(reference_decoder(latent_channels=16), tmp_path / "sixteen.safetensors")
    with pytest.raises(CheckpointError, match="16 latent channels; this pipeline's latents have 32"):
        load_taef2(tmp_path / "sixteen.safetensors", latent_channels=32)
    broken = dict(reference.state_dict())
    broken["19.bias"] = torch.zeros(4)
    save_file(broken, str(tmp_path / "broken.safetensors"))
    with pytest.raises(CheckpointError, match="'19.bias' has shape"):
        load_taef2(tmp_path / "broken.safetensors")
