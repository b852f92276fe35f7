"""Step caching (`cache=`) with everything a request can be: settings that are data compile nothing, each
image of a batch decides as it would alone, LoRAs per request equal merged ones under the same decisions,
inpainting runs cached, and bad settings are refused by name. Parity with
cache-dit itself: tests/test_step_cache_parity.py."""

import numpy as np
import PIL.Image
import pytest

from klein import StepCache
from klein.errors import InputError
from klein.pipeline.compilations import Compilations
from tests.support import lora_files as lf
from tests.support.compare import max_abs

BASE = dict(height=32, width=48, num_inference_steps=8, guidance_scale=4.0, output_type="np")
# The tiny random models' first-block residuals move by ~100% a step: reuse needs thresholds near 1.
REUSING = StepCache(threshold=0.9, single_threshold=1.2, warmup=2, max_consecutive=2)


def _picture(seed: int) -> PIL.Image.Image:
    return PIL.Image.fromarray(np.random.default_rng(seed).integers(0, 256, (64, 64, 3), np.uint8))


def _reused(out) -> int:
    report = out.step_cache
    return sum(len(report.cached_steps(g, b)) for g in ("double", "single") for b in ("cond",))


def test_cache_settings_and_uncached_requests_compile_nothing_after_the_first(pipes):
    pipe = pipes("base")
    request = dict(prompt="a cat", seed=1, **BASE)
    plain = pipe(**request).images
    first = pipe(**request, cache=REUSING)
    assert _reused(first) > 0
    changes = (
        StepCache(threshold=0.5, warmup=3, max_cached=2, max_consecutive=-1),
        StepCache(threshold=0.0),
        StepCache(mask=(1, 1, 0, 1, 0, 0, 1, 0), mask_policy="static"),
        StepCache(mask=(1, 1, 0, 1, 0, 0, 1, 0), threshold=2.0, single_threshold=0.1),
    )
    with Compilations() as built:
        outs = [pipe(**{**request, "seed": 2}, cache=cache).step_cache for cache in changes]
        again = pipe(**request).images
    assert built.names == [], f"compiled {built.names}"
    np.testing.assert_array_equal(again, plain)
    # A static mask reuses exactly its 0 steps, in both passes and both groups; under a dynamic one a
    # threshold of 1 or more always reuses there, and a small one never does.
    static, dynamic = outs[2], outs[3]
    for group in ("double", "single"):
        assert static.cached_steps(group, "cond") == static.cached_steps(group, "uncond") == [2, 4, 5, 7]
    assert dynamic.cached_steps("double", "uncond") == [2, 4, 5, 7]
    assert dynamic.cached_steps("single", "cond") == []


def test_threshold_zero_is_the_uncached_image(pipes):
    """Another program than the uncached one's: equal up to float32 rounding (a step read from the cache
    would move the image by far more)."""
    pipe = pipes("base")
    request = dict(prompt="a cat", seed=3, **BASE)
    out = pipe(**request, cache=StepCache(threshold=0.0))
    assert max_abs(out.images, pipe(**request).images) < 5e-6
    assert _reused(out) == 0 and out.step_cache.computed("double") == 16


def test_each_image_of_a_batch_decides_as_it_would_alone(pipes):
    pipe = pipes("base")
    prompts = ("a cat", "a red fox in the snow")
    latents = np.random.default_rng(0).standard_normal((2, 128, 2, 3)).astype(np.float32)
    batch = pipe(list(prompts), latents=latents, cache=REUSING, **BASE)
    for image, prompt in enumerate(prompts):
        alone = pipe(prompt, latents=latents[image : image + 1], cache=REUSING, **BASE)
        assert max_abs(batch.images[image], alone.images[0]) < 1e-5
        for group in ("double", "single"):
            for branch in ("cond", "uncond"):
                got = batch.step_cache.cached_steps(group, branch, image)
                assert got == alone.step_cache.cached_steps(group, branch), (image, group, branch)
    assert _reused(batch) > 0


def test_cfg_decided_together_pairs_the_prompt_and_its_negative(pipes):
    pipe = pipes("base")
    out = pipe(
        "a cat", seed=4, cache=REUSING.__class__(**{**REUSING.__dict__, "separate_cfg": False}), **BASE
    )
    report = out.step_cache
    for group in ("double", "single"):
        assert report.cached_steps(group, "cond") == report.cached_steps(group, "uncond")
    assert _reused(out) > 0


def test_loras_per_request_under_a_cache_equal_merged_ones(pipes, tmp_path):
    pipe = pipes("base")
    lora = lf.write_peft(
        tmp_path / "l.safetensors", lf.random_lora(lf.linear_shapes(pipe.config, "diffusers"), 4, 1)
    )
    pipe.load_lora("ink", lora)
    request = dict(prompt="a cat", seed=5, cache=REUSING, **BASE)
    unmerged = pipe(**request, loras=[("ink", 0.8)])
    pipe.set_loras([(lora, 0.8)])
    try:
        merged = pipe(**request)
    finally:
        pipe.set_loras([])
    assert max_abs(unmerged.images, merged.images) < 1e-4
    np.testing.assert_array_equal(unmerged.step_cache.cached, merged.step_cache.cached)
    assert _reused(merged) > 0


def test_inpainting_runs_cached_from_its_first_step(pipes):
    """(References and KV editing: against cache-dit itself, tests/test_step_cache_parity.py.)"""
    extra = dict(image=[_picture(0)], mask_image=PIL.Image.new("L", (64, 64), 255), strength=0.5)
    pipe = pipes("kv")
    request = dict(
        prompt="a cat", seed=6, height=32, width=48, num_inference_steps=6, output_type="np", **extra
    )
    plain = pipe(**request).images
    # Every step computing: the uncached image up to float32 rounding (the program splits the layer walk
    # where the cache decides, and XLA fuses the reference paths' parts differently; text-to-image is exact).
    assert max_abs(pipe(**request, cache=StepCache(threshold=0.0)).images, plain) < 5e-6
    out = pipe(**request, cache=StepCache(threshold=1.5, warmup=1, max_consecutive=-1))
    report = out.step_cache
    steps = len(report.phases)
    assert report.cached_steps("double") and report.cached_steps("single")
    assert not np.array_equal(out.images, plain) and np.isfinite(out.images).all()
    assert steps == 3  # inpainting at strength 0.5 runs the last 3 steps: the cache counts from the first


@pytest.mark.parametrize(
    "cache, words",
    [
        ("threshold=abc", "threshold must be a number"),
        ("thresold=0.2", "known name"),
        (dict(mask=(1, 0)), "mask has 2 entries but 8 steps run"),
        (dict(compute_first=2), "must leave blocks to reuse"),
        (dict(mask=(0,) * 8, mask_policy="static", warmup=0), "must compute a step"),
        (dict(taylorseer_order=7), "taylorseer_order"),
        (3, "cache must be True"),
    ],
)
def test_bad_settings_are_refused_by_name(pipes, cache, words):
    with pytest.raises(InputError, match=words):
        pipes("base")("a cat", cache=cache, **BASE)


def test_cache_dit_configs_are_read_and_what_klein_lacks_is_refused():
    from cache_dit import DBCacheConfig, ParamsModifier, TaylorSeerCalibratorConfig

    config = DBCacheConfig(Fn_compute_blocks=1, residual_diff_threshold=0.2, max_continuous_cached_steps=2)
    modifiers = [
        ParamsModifier(cache_config=DBCacheConfig().reset(residual_diff_threshold=0.2)),
        ParamsModifier(cache_config=DBCacheConfig().reset(residual_diff_threshold=0.6)),
    ]
    got = StepCache.of(
        dict(cache_config=config, params_modifiers=modifiers, calibrator_config=TaylorSeerCalibratorConfig())
    )
    assert got == StepCache(
        threshold=0.2, single_threshold=0.6, max_consecutive=2, max_cached=-1, taylorseer_order=1
    )
    assert StepCache.of(StepCache.parse(got.spec()).spec()) == got
    with pytest.raises(InputError, match="max_accumulated_residual_diff_threshold"):
        StepCache.of(DBCacheConfig(max_accumulated_residual_diff_threshold=0.5))
    bad = [modifiers[0], ParamsModifier(cache_config=DBCacheConfig().reset(Fn_compute_blocks=4))]
    with pytest.raises(InputError, match="also sets Fn_compute_blocks"):
        StepCache.of(dict(cache_config=config, params_modifiers=bad))
