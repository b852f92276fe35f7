"""Inpainting and image-to-image: parity with diffusers' Flux2KleinInpaintPipeline on tiny checkpoints,
cached references equal to uncached ones, and the inputs it refuses."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import PIL.Image
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinInpaintPipeline
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.flux2 import pipeline_flux2_klein_inpaint

from klein import GenerationRequest, InputError
from klein.pipeline import denoise
from klein.pipeline.loading import load_pipeline
from tests.support.compare import max_abs
from tests.support.pictures import ellipse_mask, picture

MAX_ABS = 2e-3
PROMPT = "a red fox in the snow"
SOURCE = (96, 64)  # width, height
MASK = (0.2, 0.15, 0.7, 0.8)


@pytest.fixture(scope="module")
def pipes(tiny_pipelines):
    """kind -> (klein pipeline, diffusers' inpainting pipeline over the same weights)."""
    loaded = {}

    def get(kind):
        if kind not in loaded:
            folder, reference = tiny_pipelines(kind)
            components = {name: getattr(reference, name) for name in ("vae", "text_encoder", "tokenizer")}
            inpaint = Flux2KleinInpaintPipeline(
                # Its own scheduler: inpainting sets a begin index on it.
                scheduler=FlowMatchEulerDiscreteScheduler.from_config(reference.scheduler.config),
                transformer=reference.transformer,
                is_distilled=kind != "base",
                **components,
            )
            inpaint.set_progress_bar_config(disable=True)
            loaded[kind] = load_pipeline(folder), inpaint
        return loaded[kind]

    return get


def diffusers_noise(ours, seed, monkeypatch):
    """Make diffusers draw klein's noise for `seed`: the start of the steps and the source's re-noising
    then agree on both sides without passing `latents` (which diffusers uses as the start itself)."""

    def randn(shape, generator=None, device=None, dtype=None):
        batch, _, h, w = shape
        return torch.from_numpy(ours.noise(seed, batch, h * 16, w * 16)).to(dtype)

    monkeypatch.setattr(pipeline_flux2_klein_inpaint, "randn_tensor", randn)


def compare(pipes, monkeypatch, kind="distilled", references=(), seed=7, **kwargs):
    """klein's repaint of a SOURCE picture against diffusers', both from klein's noise for `seed`; returns
    klein's images."""
    ours, theirs = pipes(kind)
    diffusers_noise(ours, seed, monkeypatch)
    kwargs.setdefault("num_inference_steps", 4)
    kwargs.setdefault("image", picture(*SOURCE, 0))
    extra = {"image_reference": references[0]} if references else {}
    want = theirs(prompt=PROMPT, output_type="np", **extra, **kwargs).images
    kwargs["image"] = [kwargs["image"], *references]
    got = ours(prompt=PROMPT, seed=seed, output_type="np", **kwargs).images
    assert got.shape == want.shape
    err = max_abs(got, want)
    assert err < MAX_ABS, err
    return got


def soft_mask():
    return ellipse_mask(*SOURCE, MASK)


@pytest.mark.parametrize("strength", [1.0, 0.6, 0.25])
def test_parity_with_diffusers_at_several_strengths(pipes, monkeypatch, strength):
    # 4 steps: strength 1.0 runs all four, 0.6 the last three, 0.25 a single one.
    compare(pipes, monkeypatch, mask_image=soft_mask(), strength=strength)


def test_parity_with_an_extra_reference_and_a_batch_of_two(pipes, monkeypatch):
    reference = picture(64, 80, 3)
    compare(pipes, monkeypatch, references=(reference,), mask_image=soft_mask(), num_images_per_prompt=2)


def test_parity_on_the_base_model_with_cfg(pipes, monkeypatch):
    got = compare(
        pipes,
        monkeypatch,
        "base",
        mask_image=soft_mask(),
        strength=0.7,
        num_inference_steps=3,
        guidance_scale=4.0,
    )
    ours, _ = pipes("base")
    unguided = ours(
        PROMPT,
        image=picture(*SOURCE, 0),
        mask_image=soft_mask(),
        strength=0.7,
        num_inference_steps=3,
        guidance_scale=1.0,
        seed=7,
        output_type="np",
    ).images
    assert max_abs(got, unguided) > 10 * MAX_ABS  # CFG really ran


def test_parity_with_padding_mask_crop(pipes, monkeypatch):
    """The repainted crop goes back resized into its place. diffusers 0.42.1's Flux2ImageProcessor
    overrides the resize of that overlay with a plain centre crop, which pastes a zoomed-in part of the
    crop; klein resizes, as diffusers' generic image processor does, and the comparison gives diffusers'
    side that same resize (docs/design.md, "Inpainting")."""
    ours, theirs = pipes("distilled")
    source, mask = picture(160, 128, 4), ellipse_mask(160, 128, (0.55, 0.5, 0.8, 0.75))
    diffusers_noise(ours, 7, monkeypatch)
    resize_back = VaeImageProcessor._resize_and_crop.__get__(theirs.image_processor)
    monkeypatch.setattr(theirs.image_processor, "_resize_and_crop", resize_back)
    kwargs = dict(mask_image=mask, padding_mask_crop=8, num_inference_steps=4, strength=0.9)
    want = theirs(prompt=PROMPT, image=source, **kwargs).images[0]
    got = ours(PROMPT, image=source, seed=7, **kwargs).images[0]
    assert got.size == want.size == source.size  # pasted back into the whole source
    assert np.abs(np.asarray(got, np.int16) - np.asarray(want, np.int16)).max() <= 1
    outside = np.asarray(mask) == 0
    assert np.array_equal(np.asarray(got)[outside], np.asarray(source)[outside])  # the overlay
    inside = np.asarray(mask) == 255
    assert np.abs(np.asarray(got, np.int16) - np.asarray(source, np.int16))[inside].max() > 20


def test_parity_for_a_mask_and_source_of_other_sizes(pipes, monkeypatch):
    # The source is resized to multiples of 16 (not cropped); the mask, twice the size, resized to it.
    odd = picture(100, 70, 5)
    with pytest.warns(UserWarning, match="mask_image 200x140 px resized to the source's 96x64 px"):
        compare(pipes, monkeypatch, image=odd, mask_image=ellipse_mask(200, 140, MASK), strength=0.8)


def test_latents_are_the_noise_and_the_start_as_in_diffusers(pipes):
    ours, theirs = pipes("distilled")
    latents = np.random.default_rng(1).standard_normal((1, 128, 4, 6)).astype(np.float32)
    kwargs = dict(image=picture(*SOURCE, 0), mask_image=soft_mask(), strength=0.6, num_inference_steps=4)
    want = theirs(prompt=PROMPT, latents=torch.from_numpy(latents), output_type="np", **kwargs).images
    got = ours(PROMPT, latents=latents, output_type="np", **kwargs).images
    assert max_abs(got, want) < MAX_ABS


def test_image_to_image_is_a_mask_that_repaints_everything(pipes, monkeypatch):
    ours, _ = pipes("distilled")
    white = PIL.Image.new("L", SOURCE, 255)
    with_mask = compare(pipes, monkeypatch, mask_image=white, strength=0.6)
    plain = ours(PROMPT, image=picture(*SOURCE, 0), strength=0.6, seed=7, output_type="np").images
    np.testing.assert_allclose(plain, with_mask, atol=1e-6)


def test_the_mask_and_the_strength_move_the_image(pipes):
    """Sensitivity: what the parity tests compare depends on the mask, the strength and the blend."""
    ours, _ = pipes("distilled")
    source = picture(*SOURCE, 0)

    def run(mask, strength=0.6):
        return ours(PROMPT, image=source, mask_image=mask, strength=strength, seed=7, output_type="np").images

    base = run(soft_mask())
    assert max_abs(run(ellipse_mask(*SOURCE, (0.3, 0.15, 0.8, 0.8))), base) > 10 * MAX_ABS
    assert max_abs(run(soft_mask(), 0.9), base) > 10 * MAX_ABS
    assert max_abs(run(None), base) > 10 * MAX_ABS  # without the blend (image-to-image)


def test_after_the_last_step_kept_tokens_are_the_source():
    """The blend: where the mask keeps, the source noised to the next level (the clean source after the
    last step), where it repaints, the step's result, and edge tokens a mix. (Pixels are not compared:
    the tiny random VAE's GroupNorm and attention spread any change over the whole picture.)"""
    rng = np.random.default_rng(0)
    source, noise, x = (jnp.asarray(rng.standard_normal((n, 6, 4)), jnp.float32) for n in (1, 2, 2))
    mask = jnp.asarray([0.0, 1.0, 0.5, 0.0, 0.25, 1.0]).reshape(1, 6, 1)
    repaint = denoise.Repaint(source, noise, mask)
    last = np.asarray(repaint.after_step(x, 0.0))
    np.testing.assert_array_equal(last[:, [0, 3]], np.broadcast_to(source[:, [0, 3]], (2, 2, 4)))
    np.testing.assert_array_equal(last[:, [1, 5]], np.asarray(x)[:, [1, 5]])
    np.testing.assert_allclose(last[:, 2], 0.5 * (source[:, 2] + x[:, 2]), atol=1e-6)
    middle = np.asarray(repaint.after_step(x, 0.5))
    np.testing.assert_allclose(middle[:, 0], 0.5 * noise[:, 0] + 0.5 * source[:, 0], atol=1e-6)
    assert repaint.start(1.0).shape == x.shape and np.array_equal(repaint.start(1.0), noise)


def test_cached_references_equal_uncached_for_kv_inpainting(pipes):
    ours, _ = pipes("kv")
    source, reference = picture(*SOURCE, 0), picture(64, 80, 3)
    encoded = ours.encode_references([source, reference], source=True)
    assert encoded.cached
    before = dict(ours.counters)
    kwargs = dict(mask_image=soft_mask(), strength=0.75, seed=3, output_type="np")
    first = ours("a hat", references=encoded, num_images_per_prompt=2, **kwargs).images
    second = ours(
        "a scarf",
        references=encoded,
        mask_image=ellipse_mask(*SOURCE, (0.1, 0.1, 0.5, 0.5)),
        strength=0.75,
        seed=3,
        output_type="np",
    ).images
    assert ours.counters["references"] == before["references"]
    assert ours.counters["prefill"] == before["prefill"]
    uncached = ours("a hat", image=[source, reference], num_images_per_prompt=2, **kwargs).images
    np.testing.assert_allclose(first, uncached, atol=1e-5)
    assert max_abs(first[0], second[0]) > 10 * MAX_ABS


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(mask_image=PIL.Image.new("L", SOURCE, 0)), "all black"),
        (dict(strength=1.5), "strength .*0 to 1"),
        (dict(strength=0.0), "no denoising step"),
        (dict(strength="high"), "strength"),
        (dict(mask_image=42), "mask_image must be"),
        (dict(padding_mask_crop=8), "padding_mask_crop needs mask_image"),
        (
            dict(mask_image=PIL.Image.new("L", SOURCE, 255), padding_mask_crop=8, output_type="np"),
            "output_type",
        ),
    ],
)
def test_bad_inpainting_inputs_name_the_field(pipes, kwargs, match):
    ours, _ = pipes("distilled")
    with pytest.raises(InputError, match=match):
        ours(PROMPT, image=picture(*SOURCE, 0), num_inference_steps=4, **kwargs)


def test_a_mask_without_an_image_is_refused(pipes):
    ours, _ = pipes("distilled")
    with pytest.raises(InputError, match="mask_image needs the image to repaint"):
        ours(PROMPT, mask_image=PIL.Image.new("L", SOURCE, 255))


def test_another_size_is_noted_and_the_source_size_kept(pipes):
    ours, _ = pipes("distilled")
    with pytest.warns(UserWarning, match="keeps its source's size"):
        out = ours(PROMPT, image=picture(*SOURCE, 0), mask_image=soft_mask(), height=32, width=32, seed=1)
    assert out.images[0].size == SOURCE
    assert out.settings.request.strength == 0.8  # diffusers' default with a mask


@pytest.mark.filterwarnings("ignore:mask_image 256x256 px resized")
def test_the_check_prepares_the_mask_as_the_run_does(pipes):
    """A 2x2 px dot on a mask four times the source's size vanishes when the whole mask is resized to
    the source, and not in the crop around it that `padding_mask_crop` repaints: the check and the run
    must both crop (they disagreed: the check refused what the run repaints)."""
    ours, _ = pipes("distilled")
    source, mask = picture(64, 64, 8), PIL.Image.new("L", (256, 256), 0)
    mask.paste(255, (80, 80, 82, 82))
    cropped = GenerationRequest.create(
        prompt=PROMPT, image=[source], mask_image=mask, padding_mask_crop=8, num_inference_steps=2, seed=3
    )
    ours.check(cropped, [(64, 64)])
    assert ours(cropped).images[0].size == (64, 64)
    whole = dataclasses.replace(cropped, padding_mask_crop=None)
    with pytest.raises(InputError, match="all black"):
        ours.check(whole, [(64, 64)])
    with pytest.raises(InputError, match="all black"):
        ours(whole)
