"""Admission: requests that cannot fit are refused before any device work, with the estimate and the
limit; requests that fit next to them run; a decode that fits only in tiles runs tiled."""

import dataclasses

import numpy as np
import pytest
from PIL import Image

from klein import GenerationRequest, InputError, sharding
from klein.memory import activations, admission, plan, process, residency
from klein.pipeline.loading import load_pipeline
from klein.request.step_cache import StepCache
from tests.test_cli import assert_clean_error, run_klein


@pytest.fixture(scope="module")
def pipe(klein_home, monkeypatch_module):
    monkeypatch_module.setenv("KLEIN_HOME", str(klein_home))
    return load_pipeline("demo")


def test_oversized_request_is_refused_before_any_work(pipe):
    before = dict(pipe.counters)
    with pytest.raises(
        InputError, match=r"needs about .* GiB .* more than the .* GiB of available host memory"
    ):
        pipe("x", height=100000, width=100000)
    with pytest.raises(InputError, match="denoise step"):
        pipe("x", num_images_per_prompt=5000)
    assert dict(pipe.counters) == before  # nothing ran: no text encoding, no step, no decode
    # A request that fits, right after, runs as usual.
    out = pipe("x", height=64, width=64, num_inference_steps=1, seed=0, output_type="np")
    assert out.images.shape == (1, 64, 64, 3)


def test_check_refuses_what_generate_would_without_running_anything(pipe):
    """`check` (what a server runs before queueing) counts the references a request will come with."""
    before = dict(pipe.counters)
    request = GenerationRequest.create(prompt="x", height=64, width=64)
    pipe.memory_limit = 64 * 2**20
    try:
        pipe.check(request)  # fits
        pipe.check(request, [(64, 64)])
        with pytest.raises(InputError, match="needs about .* more than the 64.0 MiB"):
            pipe.check(request, [(2048, 2048)] * 3)
    finally:
        pipe.memory_limit = None
    with pytest.raises(InputError, match="needs about"):
        pipe.check(GenerationRequest.create(prompt="x", height=100000, width=100000))
    assert dict(pipe.counters) == before


def test_a_memory_cap_leaves_a_request_what_the_weights_and_the_process_leave(pipe):
    """Under `memory_cap` a request may use the cap less the resident weights and, on the CPU, klein's own
    process: a cap without room for the process refuses what fits beside it, and says what the cap held."""
    held = residency.resident_weights(pipe.residency, pipe.weight_bytes)
    own = process.footprint("cpu")
    request = GenerationRequest.create(prompt="x", height=64, width=64)
    try:
        pipe.memory_cap = held + own + 64 * 2**20
        pipe.check(request)
        spent = (
            rf"more than the 64.0 MiB left of the {admission.gib(pipe.memory_cap)} memory cap beside the "
            rf"weights \({admission.gib(held)}\) and klein's own process \({own / 2**30:.2f} GiB resident"
        )
        with pytest.raises(InputError, match=spent):
            pipe.check(request, [(2048, 2048)] * 3)
        pipe.memory_cap = held + 64 * 2**20
        with pytest.raises(
            InputError, match=r"more than the 0.0 MiB left of the .* memory cap beside the weights"
        ):
            pipe.check(request)
    finally:
        pipe.memory_cap = None
    pipe.check(request)


def test_a_refusal_names_the_largest_smaller_requests_that_fit_and_they_do(pipe):
    """What the refusal offers is judged as the request would be: each offered size is admitted."""
    request = GenerationRequest.create(prompt="x", height=1024, width=1024, num_images_per_prompt=2)
    one = pipe._resolve(GenerationRequest.create(prompt="x", height=1024, width=1024), ()).workload
    # One 1024x1024 image fits, decoding in tiles; two do not.
    pipe.memory_limit = admission.estimates(pipe, pipe.mesh, one, pipe.dtype.itemsize)[1].peak
    try:
        with pytest.raises(InputError, match="these fit: ") as refused:
            pipe.check(request)
        offered = str(refused.value).split("these fit: ")[1]
        size, images = offered.split(", ")[:2]
        width, height = (int(n) for n in size.split(" px")[0].split("x"))
        assert width < 1024 and images.startswith("1 image at a time")
        pipe.check(GenerationRequest.create(prompt="x", height=height, width=width, num_images_per_prompt=2))
        pipe.check(GenerationRequest.create(prompt="x", height=1024, width=1024))
    finally:
        pipe.memory_limit = None


def test_a_decode_that_fits_only_in_tiles_runs_tiled(pipe):
    kwargs = dict(height=64, width=2048, num_inference_steps=1, seed=0, output_type="np")
    work = plan.Workload(1, 1, 64, 2048, 0, cached=False, guided=False)
    estimate = [
        plan.request_memory(
            pipe.config,
            pipe.text_config,
            pipe.vae_config,
            sharding.abstract_mesh("single"),
            work,
            4,
            tiled_decode=tiled,
        )
        for tiled in (False, True)
    ]
    plain, tiled = estimate
    assert tiled.peak < plain.peak
    plain_image = pipe("x", **kwargs).images
    pipe.memory_limit = tiled.peak
    try:
        before = pipe.counters["decode_tiled"]
        tiled_image = pipe("x", **kwargs).images
        assert pipe.counters["decode_tiled"] == before + 1
        pipe.memory_limit = tiled.peak - 1
        with pytest.raises(InputError, match="allowed"):
            pipe("x", **kwargs)
    finally:
        pipe.memory_limit = None
    assert tiled_image.shape == plain_image.shape == (1, 64, 2048, 3)
    assert np.isfinite(tiled_image).all() and tiled_image.std() > 0


@pytest.mark.parametrize(
    "args",
    [["--height", "65536", "--width", "65536", "--max-pixels", str(65536**2)], ["--num-images", "5000"]],
)
def test_cli_refuses_what_cannot_fit(klein_home, tmp_path, args):
    unlimited = ["--max-minutes", "1e9"]  # the memory check, past the estimate's (tests/test_cli_limits.py)
    result = run_klein(klein_home, "generate", "--prompt", "x", *args, *unlimited, cwd=tmp_path)
    assert_clean_error(result, "needs about", "GiB of available host memory", "ask for less")
    assert list(tmp_path.iterdir()) == []


def test_a_step_cache_counts_its_states_and_a_request_that_fits_only_without_them_is_refused(pipe):
    """A step cache's states ride along every step: per row (an image; under guidance its negative too), the
    double blocks' Fn residual of the image stream and order + 1 residuals of both streams, the single blocks'
    Fn residual of [text, image] and order + 1 of what their last blocks read (the image's rows, or [text,
    image] when a block follows the cached ones), twice (the states a step reads and those it returns)."""
    plain = GenerationRequest.create(prompt="x", height=64, width=64, num_images_per_prompt=2)
    cached = dataclasses.replace(plain, cache=StepCache(taylorseer_order=2))
    works = [pipe._resolve(request, ()).workload for request in (plain, cached)]
    budget = pipe.budget
    plain_memory, cached_memory = (
        admission.estimates(budget.models, budget.mesh, work, budget.itemsize)[0] for work in works
    )
    image, text, ladder, row = 4 * 4, plan.TEXT_TOKENS, 3, pipe.config.hidden * budget.itemsize
    double = image + ladder * (image + text)
    assert cached_memory.step_cache == 2 * 2 * (double + (text + image) + ladder * image) * row == 1114112
    assert cached_memory.peak - plain_memory.peak == cached_memory.step_cache  # the step is the widest
    behind = StepCache(compute_last=1, taylorseer_order=2).structure  # the single blocks keep [text, image]
    single = (text + image) + ladder * (text + image)
    assert (
        activations.step_cache_bytes(pipe.config, admission.planning_mesh(None), behind, 2, image, 0, 4)
        == 2 * 2 * (double + single) * row
    )
    pipe.memory_limit = 7.5 * 2**20
    try:
        pipe.check(plain)
        with pytest.raises(InputError, match=r"needs about 7\.9 MiB .*step cache 1\.1 MiB"):
            pipe.check(cached)
    finally:
        pipe.memory_limit = None


def test_references_encoded_apart_are_refused_before_their_prefill(pipe):
    """`encode_references` judges its prefill (the keys and values and its own activations) before running
    it: one byte short, refused naming the prefill, nothing run; with that byte, it runs."""
    picture = Image.new("RGB", (256, 256))
    work = plan.Workload(1, 1, 256, 256, 16 * 16, cached=True, guided=False)
    memory = admission.estimates(pipe, pipe.mesh, work, pipe.dtype.itemsize)[0]
    needed = memory.reference_kv + memory.prefill
    before = pipe.counters["prefill"]
    pipe.memory_limit, pipe.kv_dtype = needed - 1, "dtype"  # (auto would prefill them in 8 bits)
    try:
        with pytest.raises(InputError, match="kv prefill"):
            pipe.encode_references([picture])
        assert pipe.counters["prefill"] == before
        pipe.memory_limit = needed
        assert pipe.encode_references([picture]).cached
        assert pipe.counters["prefill"] == before + 1
    finally:
        pipe.memory_limit, pipe.kv_dtype = None, "auto"


def test_prefilled_references_count_once_against_free_memory(pipe, monkeypatch):
    """Free memory read live already counts the keys and values of references that come prefilled: a request
    over them needs free only what it adds; the same request with references still to prefill needs more."""
    refs = pipe.encode_references([Image.new("RGB", (256, 256))])
    request = GenerationRequest.create(prompt="x", height=64, width=64, references=refs)
    work = pipe._resolve(request, refs.pixel_sizes).workload
    plain = admission.estimates(pipe, pipe.mesh, work, pipe.dtype.itemsize)[0]
    assert work.prefilled and plain.reference_kv > 0
    free = plain.peak - plain.reference_kv
    monkeypatch.setattr(admission, "available_bytes", lambda devices: (free, "free on the device"))
    assert pipe.budget.admit(work) is False  # fits as it is: the plain decode

    def plain_fits(work) -> bool:
        try:
            return pipe.budget.admit(work) is False
        except InputError:
            return False

    assert not plain_fits(dataclasses.replace(work, prefilled=False))
    monkeypatch.setattr(admission, "available_bytes", lambda devices: (free - 1, "free on the device"))
    assert not plain_fits(work)
