"""diffusers' documented Flux2Klein call forms run unchanged against klein's pipeline (`generator`,
`output_type`, `return_dict`, `callback_on_step_end`); what klein cannot honour is refused naming the
alternative; each call draws a tqdm bar on stderr unless `set_progress_bar_config(disable=True)`."""

import jax
import numpy as np
import pytest
import torch

from klein import InputError
from klein.pipeline import prompts
from klein.pipeline.loading import load_pipeline
from klein.request import diffusers_args
from tests.support.pictures import picture

FAST = dict(height=32, width=32, num_inference_steps=2)


@pytest.mark.parametrize(
    "kind, extra",
    [
        ("distilled", {}),
        ("distilled", {"image": [picture(64, 64, 1)]}),
        ("kv", {"image": [picture(64, 64, 1), picture(64, 80, 2)]}),
        (
            "distilled",
            {
                "image": [picture(64, 64, 1)],
                "mask_image": picture(64, 64, 3),
                "strength": 0.6,
                "height": 64,
                "width": 64,
            },
        ),
    ],
    ids=["text-to-image", "editing", "kv", "inpainting"],
)
def test_a_generator_gives_the_image_of_its_seed(pipes, kind, extra):
    pipe, settings = pipes(kind), {**FAST, **extra}
    with_generator = pipe(prompt="a cat", generator=torch.Generator().manual_seed(7), **settings)
    with_seed = pipe(prompt="a cat", seed=7, **settings)
    other = pipe(prompt="a cat", generator=[torch.Generator().manual_seed(8)], **settings)
    assert with_generator.seed == 7 and other.seed == 8
    np.testing.assert_array_equal(np.asarray(with_generator.images[0]), np.asarray(with_seed.images[0]))
    assert not np.array_equal(np.asarray(with_generator.images[0]), np.asarray(other.images[0]))


def test_output_type_np_and_return_dict_false_as_diffusers(pipes):
    (images,) = pipes("distilled")(prompt="a cat", output_type="np", return_dict=False, seed=1, **FAST)
    assert isinstance(images, np.ndarray) and images.shape == (1, 32, 32, 3) and images.dtype == np.float32
    assert 0.0 <= images.min() and images.max() <= 1.0


def test_output_type_latent_is_the_decoders_input_as_diffusers_returns_it(pipes, tiny_pipelines):
    pipe = pipes("distilled")
    latents = pipe(prompt="a cat", seed=4, output_type="latent", **FAST)
    reference = tiny_pipelines("distilled")[1]
    channels = reference.vae.config.latent_channels
    assert latents.images.shape == (1, channels, 32 // 8, 32 // 8) and latents.images.dtype == np.float32
    # Decoding them with diffusers' VAE gives klein's image.
    with torch.no_grad():
        decoded = reference.vae.decode(torch.from_numpy(latents.images.copy()), return_dict=False)[0]
    pixels = ((decoded[0].permute(1, 2, 0).numpy() + 1) / 2).clip(0, 1)
    image = pipe(prompt="a cat", seed=4, output_type="np", **FAST).images[0]
    np.testing.assert_allclose(pixels, image, atol=2e-3)
    with pytest.raises(InputError, match="not images"):
        latents.save("x.png")


def test_the_step_end_callback_sees_every_step_and_may_change_the_latents(pipes):
    pipe, seen = pipes("distilled"), []

    def callback(p, step, timestep, kwargs):
        seen.append((p, step, timestep, kwargs["latents"].shape))
        return kwargs

    plain = pipe(prompt="a cat", seed=2, output_type="np", callback_on_step_end=callback, **FAST)
    assert [s[1] for s in seen] == [0, 1] and all(s[0] is pipe for s in seen)
    assert seen[0][2] > seen[1][2] > 0 and seen[0][3][0] == 1
    zeroed = pipe(
        prompt="a cat",
        seed=2,
        output_type="np",
        **FAST,
        callback_on_step_end=lambda p, i, t, kw: {"latents": np.zeros_like(kw["latents"])},
        callback_on_step_end_tensor_inputs=["latents"],
    )
    untouched = pipe(prompt="a cat", seed=2, output_type="np", **FAST)
    np.testing.assert_array_equal(plain.images, untouched.images)
    assert not np.array_equal(zeroed.images, untouched.images)


def test_with_a_strength_the_callback_counts_the_steps_that_run(pipes):
    seen = []
    pipes("distilled")(
        prompt="a cat",
        image=[picture(64, 64, 1)],
        mask_image=picture(64, 64, 3),
        strength=0.5,
        seed=0,
        num_inference_steps=4,
        callback_on_step_end=lambda p, i, t, kw: seen.append(i),
    )
    assert seen == [0, 1]


def test_diffusers_defaults_are_accepted(pipes):
    out = pipes("distilled")(
        prompt="a cat",
        seed=3,
        max_sequence_length=512,
        text_encoder_out_layers=(9, 18, 27),
        attention_kwargs=None,
        sigmas=None,
        prompt_embeds=None,
        **FAST,
    )
    assert out.seed == 3
    assert diffusers_args.PROMPT_TOKENS == prompts.MAX_LENGTH  # the one accepted length is the encoder's


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"output_type": "pt"}, "needs torch.*'np'"),
        ({"prompt_embeds": np.zeros((1, 4, 8))}, "encodes prompts.*prompt="),
        ({"negative_prompt_embeds": np.zeros((1, 4, 8))}, "empty prompt.*guidance_scale"),
        ({"image_reference": [picture(64, 64, 1)]}, r"image=\[source, \*references\]"),
        ({"max_sequence_length": 256}, "must be 512"),
        ({"text_encoder_out_layers": (1, 2, 3)}, "must be"),
        ({"attention_kwargs": {"scale": 0.5}}, "set_loras"),
        ({"generator": [torch.Generator(), torch.Generator()]}, "one generator or seed="),
        ({"generator": 5}, "seed="),
        ({"generator": torch.Generator(), "seed": 1}, "seed or generator"),
        ({"callback_on_step_end_tensor_inputs": ["prompt_embeds"]}, "'latents'"),
    ],
)
def test_refused_arguments_name_the_alternative(pipes, kwargs, match):
    with pytest.raises(InputError, match=match):
        pipes("distilled")(prompt="a cat", **FAST, **kwargs)


def test_each_call_draws_a_progress_bar_unless_disabled(tiny_pipelines, capfd):
    pipe = load_pipeline(tiny_pipelines("distilled")[0])
    pipe(prompt="a cat", seed=0, **FAST)
    drawn = capfd.readouterr().err
    assert "4/4" in drawn and "decoding" in drawn
    pipe.set_progress_bar_config(disable=True)
    pipe(prompt="a cat", seed=0, **FAST)
    assert "4/4" not in capfd.readouterr().err
    pipe.set_progress_bar_config()
    pipe(prompt="a cat", seed=0, progress=lambda event: None, **FAST)
    assert "4/4" not in capfd.readouterr().err  # a caller's own progress (the CLI's bars) replaces it


STAGED = dict(
    prompt="a stage", image=[picture(96, 64, 4)], height=32, width=48, num_inference_steps=2, seed=0
)
"""A size no other test of the module runs: its first call compiles the steps and the decoder."""


def test_stages_are_told_as_they_start_compile_and_end_from_one_place(pipes):
    """The pipeline's stage events, which the CLI, the tqdm bar and the server's job events all read."""
    pipe, heard = pipes("distilled"), []
    jax.clear_caches()  # as in a new process: pipelines of one model share their programs in this one
    pipe(progress=heard.append, **STAGED)
    started = [e.stage for e in heard if e.done == 0 and not (e.compiling or e.finished)]
    ended = [e for e in heard if e.finished]
    assert started == [e.stage for e in ended] == ["text", "references", "denoise", "decode"]
    assert [e.label for e in ended] == ["encoding prompt", "encoding references", "denoising", "decoding"]
    assert all(e.seconds > 0 for e in ended)
    assert [(e.done, e.total) for e in heard if e.is_step] == [(1, 2), (2, 2)]
    compiled = [e for e in heard if e.compiling]
    assert {"denoise", "decode"} <= {e.stage for e in compiled}
    assert len(compiled) == len({e.stage for e in compiled})  # once per stage, as its compilation starts
    # Each stage's compiling event comes between its start and its end.
    for event in compiled:
        index = heard.index(event)
        assert heard[index - 1].stage == event.stage and not heard[index - 1].finished
    assert sum(e.compile_seconds for e in ended if e.stage in ("denoise", "decode")) > 0
    heard.clear()
    pipe(progress=heard.append, **STAGED)
    assert not [e for e in heard if e.compiling]  # compiled once: the second run only runs
    assert [e.compile_seconds for e in heard if e.finished] == [0.0] * 4


def test_the_bar_names_each_stage_as_it_runs(pipes, capfd):
    pipe = pipes("distilled")
    pipe.set_progress_bar_config()
    try:
        pipe(**STAGED)
    finally:
        pipe.set_progress_bar_config(disable=True)
    drawn = [line for line in capfd.readouterr().err.replace("\r", "\n").split("\n") if line.strip()]
    labels = [line.split(":")[0].strip() for line in drawn]
    assert labels.index("encoding references") < labels.index("denoising") < labels.index("decoding")
    assert "denoise" not in labels[: labels.index("denoising")]  # the references are not "denoise"
    assert "| 5/5 [" in drawn[-1]  # 2 steps and 3 stages
