"""End-to-end parity with diffusers' Flux2KleinPipeline / Flux2KleinKVPipeline on tiny checkpoints,
reusable references, and pipeline-level input errors."""

import numpy as np
import pytest
import torch
from skimage.metrics import structural_similarity

from klein import InputError
from klein.pipeline.loading import load_pipeline
from tests.support.compare import max_abs
from tests.support.pictures import picture

MAX_ABS = 2e-3
MIN_SSIM = 0.999


@pytest.fixture(scope="module")
def pipes(tiny_pipelines):
    loaded = {}

    def get(kind):
        if kind not in loaded:
            folder, reference = tiny_pipelines(kind)
            loaded[kind] = load_pipeline(folder), reference
        return loaded[kind]

    return get


def compare(ours, reference, prompt, batch, h, w, **kwargs):
    latents = np.random.default_rng(0).standard_normal((batch, 128, h // 16, w // 16)).astype(np.float32)
    want = reference(prompt=prompt, latents=torch.from_numpy(latents), output_type="np", **kwargs).images
    got = ours(prompt, latents=latents, output_type="np", **kwargs).images
    assert got.shape == want.shape
    err = max_abs(got, want)
    ssim = min(
        structural_similarity(g, x, channel_axis=-1, data_range=1.0) for g, x in zip(got, want, strict=True)
    )
    assert err < MAX_ABS and ssim >= MIN_SSIM, (err, ssim)
    return got


REFS_1 = [(96, 64)]
REFS_3 = [(90, 120), (64, 80), (70, 70)]  # non-square; the first and last need a crop to multiples of 16


@pytest.mark.parametrize(
    "kind,ref_sizes,per_prompt",
    [
        ("distilled", [], 1),
        ("distilled", REFS_1, 1),
        ("distilled", REFS_3, 1),
        ("kv", REFS_1, 1),
        ("kv", REFS_3, 1),
        ("distilled", [], 2),
        ("kv", REFS_3, 2),
    ],
)
def test_parity_with_diffusers(pipes, kind, ref_sizes, per_prompt):
    ours, reference = pipes(kind)
    refs = [picture(w, h, i) for i, (w, h) in enumerate(ref_sizes)]
    h, w = (48, 64) if not refs else (ref_sizes[0][1] // 16 * 16, ref_sizes[0][0] // 16 * 16)
    kwargs = dict(num_inference_steps=4, num_images_per_prompt=per_prompt)
    if refs:
        kwargs["image"] = refs
    else:
        kwargs.update(height=h, width=w)
    compare(ours, reference, "a red fox in the snow", per_prompt, h, w, **kwargs)


def test_base_with_cfg(pipes):
    ours, reference = pipes("base")
    assert ours.variant.guidance == 4.0 and ours.variant.steps == 50
    got = compare(ours, reference, "a lighthouse", 1, 32, 48, height=32, width=48, num_inference_steps=3)
    unguided = ours(
        "a lighthouse",
        height=32,
        width=48,
        num_inference_steps=3,
        guidance_scale=1.0,
        latents=np.random.default_rng(0).standard_normal((1, 128, 2, 3)).astype(np.float32),
        output_type="np",
    ).images
    assert max_abs(got, unguided) > 0.05  # CFG really changes the image


@pytest.mark.parametrize("kind,steps", [("base", None), ("distilled", 3), ("distilled", 6)])
def test_a_schedule_of_ones_own_equals_diffusers(pipes, kind, steps):
    """diffusers' `sigmas=`: the steps are the sigmas', the shift is read at the call's num_inference_steps
    (its default when not given: 50 for the base model in both), 6 given for 3 sigmas included."""
    ours, reference = pipes(kind)
    given = {} if steps is None else {"num_inference_steps": steps}
    got = compare(
        ours, reference, "a lighthouse", 1, 32, 48, height=32, width=48, sigmas=[1.0, 0.55, 0.2], **given
    )
    latents = np.random.default_rng(0).standard_normal((1, 128, 2, 3)).astype(np.float32)
    own = ours("a lighthouse", height=32, width=48, num_inference_steps=3, latents=latents, output_type="np")
    assert max_abs(got, own.images) > 0.01  # the given schedule, not the model's of as many steps, ran


def test_prompt_and_reference_move_the_image(pipes):
    """Sensitivity: the parity tests compare images that depend on what they claim to test."""
    ours, _ = pipes("kv")
    latents = np.random.default_rng(0).standard_normal((1, 128, 4, 6)).astype(np.float32)

    def run(prompt, ref_seed):
        image = picture(96, 64, ref_seed)
        return ours(prompt, image=image, latents=latents, output_type="np").images

    base = run("a red fox", 0)
    assert max_abs(run("a blue whale", 0), base) > 20 * MAX_ABS
    # The tiny random VAE damps what a reference changes; still well beyond the parity tolerance.
    assert max_abs(run("a red fox", 1), base) > 2 * MAX_ABS


def test_encoded_references_are_reused(pipes):
    ours, _ = pipes("kv")
    images = [picture(96, 64, 0), picture(64, 80, 1)]
    refs = ours.encode_references(images)
    before = dict(ours.counters)
    first = ours("a cat", references=refs, seed=1, output_type="np", num_images_per_prompt=2).images
    second = ours("a dog", references=refs, seed=2, output_type="np").images
    assert ours.counters["references"] == before["references"]
    assert ours.counters["prefill"] == before["prefill"]
    assert ours.counters["text"] == before.get("text", 0) + 2
    np.testing.assert_allclose(
        first,
        ours("a cat", image=images, seed=1, output_type="np", num_images_per_prompt=2).images,
        atol=1e-5,
    )
    np.testing.assert_allclose(
        second, ours("a dog", image=images, seed=2, output_type="np").images, atol=1e-5
    )


def test_use_kv_on_non_kv_checkpoint_names_the_kv_checkpoint(pipes):
    ours, _ = pipes("distilled")
    with pytest.raises(InputError, match="klein-9b-kv"):
        ours("a cat", image=picture(64, 64, 0), use_kv=True)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(height=0, width=64), "too small"),
        (dict(height=-32, width=64), "too small"),
        (dict(num_inference_steps=0), "num_inference_steps must be a positive integer"),
        (dict(num_inference_steps=-1), "num_inference_steps must be a positive integer"),
        (dict(num_images_per_prompt=0), "num_images_per_prompt"),
        (dict(output_type="tensor"), "output_type must be"),
        (dict(latents=np.zeros((1, 128, 3, 3), np.float32), height=64, width=64), "latents must have shape"),
    ],
)
def test_bad_arguments(pipes, kwargs, match):
    ours, _ = pipes("distilled")
    with pytest.raises(InputError, match=match):
        ours("a cat", **kwargs)


def test_size_not_multiple_of_16_is_rounded_with_a_warning(pipes):
    ours, _ = pipes("distilled")
    with pytest.warns(UserWarning, match="rounded down"):
        out = ours("a cat", height=40, width=70, num_inference_steps=1, output_type="np")
    assert out.images.shape == (1, 32, 64, 3)


def test_the_diffusers_call_forms_equal_the_positional_one(pipes):
    """Ported diffusers scripts pass everything by keyword (`prompt=`, `image=[...]`); klein's own
    examples put the prompt first or pass a `GenerationRequest`: all three make the same images."""
    from klein import GenerationRequest

    ours, _ = pipes("distilled")
    refs = [picture(96, 64, 1), picture(64, 80, 2)]
    settings = dict(height=64, width=96, num_inference_steps=2, guidance_scale=1.0, seed=5, output_type="np")
    keyword = ours(prompt="a red fox in snow", image=refs, **settings).images
    positional = ours("a red fox in snow", image=refs, **settings).images
    request = ours(GenerationRequest(prompt="a red fox in snow", image=tuple(refs), **settings)).images
    text_only = ours(prompt=["a red fox", "a blue fox"], num_inference_steps=2, height=32, width=32)
    assert keyword.shape == (1, 64, 96, 3)
    np.testing.assert_array_equal(keyword, positional)
    np.testing.assert_array_equal(keyword, request)
    assert len(text_only.images) == 2 and text_only.images[0].size == (32, 32)
