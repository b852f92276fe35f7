"""`kv_dtype`: a KV variant's reference keys and values in 8 bits, asked for or taken by `auto` where the
compute dtype's do not fit; the image they give close to the compute dtype's; `klein plan` choosing and
counting them."""

import dataclasses
import json

import numpy as np
import pytest
from PIL import Image

from klein import GenerationRequest, InputError
from klein.cli.tools import plan_command, plan_parser
from klein.memory import admission, plan
from klein.pipeline import admitting, warmup
from klein.pipeline.cache import ByteBudgetCache
from klein.pipeline.compilations import Compilations
from klein.pipeline.loading import load_pipeline

IMAGE_TOL = 4 / 255
"""Largest mean absolute difference of the demo's image over 8-bit keys and values from the same over float
ones (pixels in [0, 1])."""


@pytest.fixture(scope="module")
def pipe(klein_home, monkeypatch_module):
    monkeypatch_module.setenv("KLEIN_HOME", str(klein_home))
    return load_pipeline("demo")


def _request(**kwargs):
    picture = Image.fromarray(np.random.default_rng(0).integers(0, 255, (128, 128, 3), np.uint8))
    return GenerationRequest.create(
        prompt="a red cube", height=128, width=128, image=[picture], seed=3, output_type="np", **kwargs
    )


def _peak(pipe, request, kv_dtype):
    work = dataclasses.replace(pipe._resolve(request, [(128, 128)]).workload, kv_dtype=kv_dtype)
    return pipe.budget._beyond(admission.estimates(pipe, pipe.mesh, work, pipe.dtype.itemsize)[0])


def test_int8_keys_and_values_give_an_image_close_to_the_compute_dtypes(pipe):
    try:
        pipe.kv_dtype = "dtype"
        want = np.asarray(pipe.generate(_request()).images[0])
        pipe.kv_dtype = "int8"
        got = np.asarray(pipe.generate(_request()).images[0])
    finally:
        pipe.kv_dtype = "auto"
    difference = float(np.abs(got - want).mean())
    print(f"demo image over int8 keys and values: mean |difference| {difference * 255:.3f} / 255")
    assert 0 < difference < IMAGE_TOL


def test_auto_takes_int8_only_where_the_compute_dtypes_do_not_fit(pipe):
    request = _request()
    full, eight = _peak(pipe, request, None), _peak(pipe, request, "int8")
    assert eight < full
    before = pipe.counters["prefill"]
    try:
        pipe.memory_limit = full - 1
        pipe.kv_dtype = "dtype"
        with pytest.raises(InputError, match="reference kv"):
            pipe.generate(request)
        assert pipe.counters["prefill"] == before  # refused before any work
        assert (
            pipe.budget.admit_kv(pipe._resolve(request, [(128, 128)]).workload, "auto", full - 1)[1].kv_dtype
            == "int8"
        )
        assert (
            pipe.budget.admit_kv(pipe._resolve(request, [(128, 128)]).workload, "auto", full)[1].kv_dtype
            is None
        )
        pipe.kv_dtype = "auto"
        pipe.generate(request)  # runs in 8 bits
        assert pipe.counters["prefill"] == before + 1
        pipe.memory_limit = eight - 1
        with pytest.raises(InputError, match="reference kv"):
            pipe.generate(request)
    finally:
        pipe.memory_limit, pipe.kv_dtype = None, "auto"


def test_references_encoded_apart_take_int8_where_a_request_over_them_would_not_fit(pipe):
    picture = Image.new("RGB", (128, 128), "red")
    assert pipe.encode_references([picture]).kv.kv_dtype is None
    work = plan.Workload(1, 1, 128, 128, 64, True, False, prefilled=True)
    full = pipe.budget._beyond(admission.estimates(pipe, pipe.mesh, work, pipe.dtype.itemsize)[0])
    try:
        pipe.memory_limit = full - 1
        refs = pipe.encode_references([picture])
        assert refs.kv.kv_dtype == "int8" and refs.kv.scales is not None
        pipe.memory_limit = None
        request = GenerationRequest.create(prompt="a red cube", height=128, width=128, references=refs)
        pipe.generate(request)  # admitted with their keys and values counted in 8 bits
    finally:
        pipe.memory_limit = None


def _plan(capsys, *args):
    assert (
        plan_command(plan_parser().parse_args(["--model", "klein-9b-kv", "--device", "tpu-v5e", *args])) == 0
    )
    return capsys.readouterr().out


def test_plan_takes_int8_keys_and_values_for_four_references_on_a_v5e(capsys):
    bf16 = ("--text-encoder-weights", "dtype")  # the text encoder taking turns, as before its 4-bit form
    report = json.loads(_plan(capsys, "--refs", "4", "--json", *bf16))
    assert report["kv_dtype"] == "int8" and report["auto"] == "sequential"
    assert report["request_bytes"]["reference_kv"] == 2 * 32 * 16384 * 4096 + 2 * 32 * 32 * 4
    two = json.loads(_plan(capsys, "--refs", "2", "--json", *bf16))
    assert two["kv_dtype"] == "dtype" and two["request_bytes"]["reference_kv"] == 4 * 2**30
    asked = _plan(capsys, "--refs", "2", "--kv-dtype", "int8", *bf16)
    assert "reference keys and values in int8" in asked and "2.00 GiB" in asked
    # With the 4-bit text encoder auto keeps there, every model stays for 2 references in 8 bits.
    auto = json.loads(_plan(capsys, "--refs", "2", "--json"))
    assert (auto["auto"], auto["kv_dtype"], auto["text_encoder_weights"]) == ("all", "int8", "Q4_0")


def test_a_request_whose_prompts_are_kept_is_admitted_without_the_text_encoders_turn(pipe):
    """Over references encoded apart, a kept prompt needs no text encoder: its turn is left out (4 warm
    references on a v5e fit so); a new prompt brings it back, and is refused where that does not fit."""
    refs = pipe.encode_references([Image.new("RGB", (128, 128), "blue")])
    kept = GenerationRequest.create(prompt="kept", height=128, width=128, references=refs)
    work = pipe._resolve(kept, refs.pixel_sizes).workload
    cached = dataclasses.replace(work, text_cached=True)
    estimate = admission.estimates(pipe, pipe.mesh, cached, pipe.dtype.itemsize)[0]
    whole = admission.estimates(pipe, pipe.mesh, work, pipe.dtype.itemsize)[0]
    assert estimate.text == 0 and pipe.budget._beyond(estimate) < pipe.budget._beyond(whole)
    saved = pipe.prompt_cache
    pipe.prompt_cache = ByteBudgetCache(2**24)
    try:
        pipe.encode_prompt(["kept"])
        pipe.memory_limit = pipe.budget._beyond(estimate)
        assert admitting.admit(pipe, pipe._resolve(kept, refs.pixel_sizes), turns=False)[1].text_cached
        pipe.generate(kept)
        new = dataclasses.replace(kept, prompt="new")
        with pytest.raises(InputError, match="text encoder"):
            pipe.generate(new)
    finally:
        pipe.memory_limit, pipe.prompt_cache = None, saved


def test_warm_up_compiles_both_where_a_kept_prompt_and_a_new_one_store_them_apart(pipe):
    """Where the compute dtype's keys and values fit beside a kept prompt but a new prompt's text encoder
    leaves room only for 8-bit ones, `auto` takes either: the warm-up (whose own prompt is kept after its
    first request) compiles both prefills, so that an edit with a new prompt then compiles nothing."""
    shape = warmup.Shape(2, height=128, width=128)
    run = pipe._resolve(warmup.request(shape), [(128, 128)] * 2)
    new = dataclasses.replace(run.workload, text_cached=False, kv_dtype="int8")
    limit = pipe.budget._beyond(admission.estimates(pipe, pipe.mesh, new, pipe.dtype.itemsize)[0])
    fallback, saved = pipe.warm_buckets.fallback, pipe.prompt_cache
    try:
        pipe.memory_limit = limit
        assert admitting.kv_choices(pipe, run) == ("int8",)  # no prompt cache (residency all): none kept
        pipe.prompt_cache = ByteBudgetCache(2**24)  # as under sequential residency
        assert admitting.kv_choices(pipe, run) == ("int8", "dtype")  # a new prompt, a kept one
        with Compilations() as built:
            warmup.warm(pipe, [shape])
        assert {"prefill", "prefill_int8"} <= {name[4:-1] for name in built.names}, built.names
        pictures = [Image.new("RGB", (128, 128), colour) for colour in ("red", "blue")]
        edit = GenerationRequest.create(prompt="a new prompt", image=pictures, num_inference_steps=1)
        with Compilations() as built:
            pipe.generate(edit)
        assert not {name for name in built.names if "prefill" in name or "step" in name}, built.names
    finally:
        pipe.memory_limit, pipe.warm_buckets.fallback, pipe.prompt_cache = None, fallback, saved
