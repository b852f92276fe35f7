"""`pipe(..., preview=..., callback_on_step_end=fn)`: each step's callback also finds that step's frames,
TAEF2's decoding of the latents it sees, one per image at the output's size; previews change nothing of
the generation; a missing file or a wrong argument is refused saying what to do."""

import numpy as np
import pytest

from klein.errors import InputError
from klein.io import taef2_checkpoint
from klein.pipeline.preview import Previewer
from tests.support.taef2_reference import reference_decoder, reference_frames, save_reference

FAST = dict(height=48, width=64, num_inference_steps=2, seed=3)
"""A size other modules run too (its programs may be built already), wider than high."""


@pytest.fixture(scope="module")
def taef2(tmp_path_factory):
    """(path of random TAEF2 weights in the published decoder layout, the reference decoder)."""
    decoder = reference_decoder(seed=1).half().float()
    path = tmp_path_factory.mktemp("taef2") / "taef2_decoder.safetensors"
    save_reference(decoder, path)
    return path, decoder


def test_each_step_hands_the_callback_taef2s_frames_of_its_latents(pipes, taef2):
    path, decoder = taef2
    pipe, seen = pipes("distilled"), []

    def callback(p, step, timestep, kwargs):
        seen.append((kwargs["latents"], kwargs["preview"]))
        return kwargs

    out = pipe(prompt="a cat", num_images_per_prompt=2, preview=path, callback_on_step_end=callback, **FAST)
    plain = pipe(prompt="a cat", num_images_per_prompt=2, **FAST)
    assert len(seen) == 2
    for latents, frames in seen:
        assert len(frames) == 2 and all(frame.size == (64, 48) and frame.mode == "RGB" for frame in frames)
        expected = reference_frames(decoder, latents, 3, 4).clip(0, 1)
        got = np.stack([np.asarray(frame) for frame in frames]) / 255
        np.testing.assert_allclose(got, expected, atol=0.5 / 255 + 1e-4)
    assert not np.array_equal(np.asarray(seen[0][1][0]), np.asarray(seen[1][1][0]))
    for a, b in zip(out.images, plain.images, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_preview_true_reads_klein_s_folder_and_says_what_to_download(pipes, taef2, tmp_path, monkeypatch):
    pipe, frames = pipes("distilled"), []
    monkeypatch.setenv("KLEIN_HOME", str(tmp_path))
    callback = lambda p, step, timestep, kwargs: frames.append(kwargs["preview"])  # noqa: E731
    with pytest.raises(InputError) as caught:
        pipe(prompt="a cat", preview=True, callback_on_step_end=callback, **FAST)
    message = str(caught.value)
    assert str(tmp_path / "taef2.safetensors") in message and taef2_checkpoint.DOWNLOAD in message
    assert frames == []
    (tmp_path / "taef2.safetensors").write_bytes(taef2[0].read_bytes())
    pipe(prompt="a cat", preview=True, callback_on_step_end=callback, **FAST)
    assert len(frames) == 2 and frames[0][0].size == (64, 48)


def test_only_the_frames_a_callback_reads_are_decoded(pipes, taef2, monkeypatch):
    decoded, seen = [], []
    images = Previewer.images
    monkeypatch.setattr(Previewer, "images", lambda self, *args: decoded.append(1) or images(self, *args))

    def every_other_step(p, step, timestep, kwargs):
        assert "preview" in kwargs
        seen.append(kwargs["preview"] if step % 2 else kwargs.get("latents").shape)

    pipes("distilled")(prompt="a cat", preview=taef2[0], callback_on_step_end=every_other_step, **FAST)
    assert len(decoded) == 1 and len(seen) == 2 and len(seen[1]) == 1


@pytest.mark.parametrize(
    "settings, words",
    [
        ({"preview": True}, "no callback is given: pass callback_on_step_end=fn"),
        ({"preview": 3, "callback_on_step_end": print}, "preview must be True .* got int"),
    ],
)
def test_preview_without_a_callback_or_a_path_is_refused(pipes, settings, words):
    with pytest.raises(InputError, match=words):
        pipes("distilled")(prompt="a cat", **settings, **FAST)
