"""LoRAs per request, unmerged (`pipe.load_lora`, `loras=`): each request equals the pipeline with the same
LoRA merged, in every layout klein reads; a batch mixing three LoRAs and none equals four merged runs; new
LoRAs or strengths build no program; cached references are prefilled under the request's LoRAs and never
reused under another's."""

import dataclasses
import json

import numpy as np
import PIL.Image
import pytest

from klein.errors import CannotFitError, InputError
from klein.lora.slots import AdapterSlots
from klein.memory.admission import estimates
from klein.pipeline.compilations import Compilations
from klein.request.loras import LoraUse
from klein.request.request import GenerationRequest
from tests.support import lora_files as lf
from tests.support.compare import max_abs
from tests.support.pictures import picture

PARITY = 1e-4
LATENTS = np.random.default_rng(0).standard_normal((4, 128, 3, 4)).astype(np.float32)
T2I = dict(height=48, width=64, num_inference_steps=2, output_type="np")


def _onetrainer(path, lora):
    """OneTrainer's layout: kohya-style keys with diffusers names (`lora_transformer_`)."""
    tensors = {}
    for module, (down, up) in lora.items():
        name = "lora_transformer_" + module.replace(".", "_")
        tensors |= {f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up}
        tensors[f"{name}.alpha"] = np.array(2.0, np.float32)
    return lf._save(path, tensors)


@pytest.fixture(scope="module")
def layouts(pipes, tiny_pipelines, tmp_path_factory):
    """layout -> a LoRA file, one for every layout klein reads (BFL ones with the swapped final adaLN and
    kohya's block-diagonal fused q/k/v), all loaded by name into the distilled pipeline."""
    pipe, folder = pipes("distilled"), tmp_path_factory.mktemp("lora-layouts")
    peft, bfl = lf.linear_shapes(pipe.config, "diffusers"), lf.linear_shapes(pipe.config, "bfl")
    kohya = lf.random_lora(bfl, 4, 7)
    qkv = "double_blocks.1.txt_attn.qkv"
    kohya[qkv] = lf.block_diagonal(*kohya[qkv])
    transformer = tiny_pipelines("distilled")[1].transformer
    files = {
        "peft-trained": lf.write_peft_trained(
            folder / "a.safetensors", transformer, rank=4, alpha=8.0, seed=1
        ),
        "peft": lf.write_peft(folder / "b.safetensors", lf.random_lora(peft, 8, 2)),
        "bfl": lf.write_bfl(folder / "c.safetensors", lf.random_lora(bfl, 4, 3)),
        "bfl-down-up": lf.write_bfl(
            folder / "d.safetensors", lf.random_lora(bfl, 2, 4), ("lora_down", "lora_up"), alpha=1.0
        ),
        "fal": lf.write_bfl(folder / "e.safetensors", lf.random_lora(bfl, 4, 5), prefix="base_model.model."),
        "comfyui": lf.write_bfl(
            folder / "f.safetensors", lf.random_lora(bfl, 4, 6), prefix="model.diffusion_model."
        ),
        "kohya": lf.write_kohya(folder / "g.safetensors", kohya, alpha=2.0),
        "onetrainer": _onetrainer(folder / "h.safetensors", lf.random_lora(peft, 4, 8)),
    }
    for name, file in files.items():
        pipe.load_lora(name, file)
    return files


def _merged(pipe, specs, prompt="a red fox", latents=LATENTS[:1]):
    pipe.set_loras(specs)
    try:
        return pipe(prompt, latents=latents, **T2I).images
    finally:
        pipe.set_loras([])


LAYOUTS = ("peft-trained", "peft", "bfl", "bfl-down-up", "fal", "comfyui", "kohya", "onetrainer")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_unmerged_equals_merged(pipes, layouts, layout):
    pipe = pipes("distilled")
    want = _merged(pipe, [(layouts[layout], 0.7)])
    got = pipe("a red fox", latents=LATENTS[:1], loras=[(layout, 0.7)], **T2I)
    assert max_abs(got.images, want) <= PARITY
    assert max_abs(pipe("a red fox", latents=LATENTS[:1], **T2I).images, want) > 100 * PARITY
    assert [(a.name, a.scale) for a in got.settings.adapters[0]] == [(layout, 0.7)]


def test_two_loras_of_one_request_add_up(pipes, layouts):
    pipe = pipes("distilled")
    want = _merged(pipe, [(layouts["bfl"], 0.7), (layouts["peft"], -0.4)])
    got = pipe("a red fox", latents=LATENTS[:1], loras=["bfl:0.7", {"name": "peft", "scale": -0.4}], **T2I)
    assert max_abs(got.images, want) <= PARITY


def test_a_batch_mixing_three_loras_and_none_equals_four_merged_runs(pipes, layouts):
    pipe = pipes("distilled")
    prompts = ("a red fox", "a blue bird", "a green frog", "a grey cat")
    sets = [[("kohya", 0.8)], [("fal", 0.5)], [("onetrainer", 1.2), ("kohya", 0.3)], []]
    batch = pipe(prompts, latents=LATENTS, loras=sets, **T2I).images
    for i, uses in enumerate(sets):
        want = _merged(pipe, [(layouts[n], s) for n, s in uses], prompts[i], LATENTS[i : i + 1])
        assert max_abs(batch[i : i + 1], want) <= PARITY, i
    assert max_abs(batch[0], batch[3]) > 100 * PARITY  # the rows differ: each is its own LoRA's


def test_other_loras_and_strengths_build_no_program(pipes, layouts):
    pipe = pipes("distilled")
    pipe(("a", "b"), latents=LATENTS[:2], loras=[[("bfl", 0.5)], [("peft", 1.0)]], **T2I)
    with Compilations() as built:
        # Other slots (one given up to another LoRA: slots are fewer than the loaded LoRAs), other strengths.
        for sets in ([[("comfyui", 0.9)], []], [[("kohya", 0.1), ("fal", 2.0)], [("peft-trained", 0.3)]]):
            pipe(("a", "b"), latents=LATENTS[:2], loras=sets, **T2I)
    assert built.names == []
    assert len(pipe.adapters.names) > pipe.adapters.slots


def test_kv_references_are_prefilled_under_the_requests_lora_and_never_reused_under_another(pipes, tmp_path):
    pipe = pipes("kv")
    shapes = lf.linear_shapes(pipe.config, "bfl")
    files = {
        n: lf.write_bfl(tmp_path / f"{n}.safetensors", lf.random_lora(shapes, 4, s))
        for n, s in (("a", 1), ("b", 2))
    }
    for name, file in files.items():
        pipe.load_lora(name, file)
    image, run = picture(96, 64, 1), dict(seed=3, num_inference_steps=2, output_type="np")
    refs = pipe.encode_references(image)  # prefilled without LoRAs
    images = {}
    for name in ("a", "b"):
        prefills = pipe.counters["prefill"]
        cached = pipe("a cat", references=refs, loras=[(name, 0.7)], **run).images
        assert pipe.counters["prefill"] == prefills + 1  # never the keys/values of another set
        uncached = pipe("a cat", image=image, loras=[(name, 0.7)], **run).images
        assert max_abs(cached, uncached) <= PARITY
        pipe.set_loras([(files[name], 0.7)])
        try:
            assert max_abs(cached, pipe("a cat", image=image, **run).images) <= PARITY
        finally:
            pipe.set_loras([])
        images[name] = cached
    assert max_abs(images["a"], images["b"]) > 100 * PARITY
    with pytest.raises(InputError, match="one set of LoRAs"):
        pipe(("x", "y"), references=refs, loras=[[("a", 1.0)], [("b", 1.0)]], **run)


@pytest.mark.parametrize(
    ("loras", "words"),
    [
        ([("nope", 1.0)], "no LoRA named 'nope' is loaded"),
        ([("bfl", float("nan"))], "a number from -100 to 100"),
        ([("bfl", 1e39)], "a number from -100 to 100"),
        ([("bfi", 1.0)], "is loaded; did you mean 'bfl'?"),
        (["bfl:x"], "must be a number"),
        ([("bfl", 1.0), "bfl:0.5"], "named twice"),
        ([[("bfl", 1.0)], [], []], "3 sets given for 1 prompts"),
        ([{"name": "bfl", "path": "/etc/passwd"}], "unknown key 'path' in loras"),
        ([{"name": "bfl", "weight": 0.5}], r"unknown key 'weight' in loras\[0\]; did you mean 'scale'\?"),
        (["bfl", "peft", "fal", "kohya", "comfyui"], "5 LoRAs at once, more than the 4 adapter slots"),
        (["../bfl"], "is a path"),
        ([("/etc/passwd", 1.0)], "is a path"),
    ],
)
def test_bad_loras_are_refused_by_name(pipes, layouts, loras, words):
    with pytest.raises(InputError, match=words):
        pipes("distilled")("a red fox", loras=loras, **T2I)


def test_generate_applies_a_lora_file_unmerged_as_merging_it_would(klein_home, tmp_path, monkeypatch):
    """`klein generate --lora-apply FILE:SCALE`: the file offered under its name and applied by it; the
    image is the merged one's (the demo computes in bf16: within a level or two), the metadata names it."""
    from klein.cli.main import main
    from klein.io import demo
    from klein.models.transformer_config import TransformerConfig

    monkeypatch.setenv("KLEIN_HOME", str(klein_home))
    shapes = lf.linear_shapes(TransformerConfig.from_diffusers(demo.TRANSFORMER), "bfl")
    file = lf.write_bfl(tmp_path / "ink.safetensors", lf.random_lora(shapes, 4, 2))
    words = ["generate", "prompt=a fox", "height=64", "width=64", "steps=2", "seed=3"]
    pictures = {}
    for how, flags in {
        "merged": ["--lora", f"{file}:0.8"],
        "unmerged": ["--lora-apply", f"{file}:0.8"],
    }.items():
        assert main([*words, *flags, "--out", str(tmp_path / f"{how}.png")]) == 0
        pictures[how] = PIL.Image.open(tmp_path / f"{how}.png")
    unmerged, merged = (np.asarray(pictures[how], np.float32) for how in ("unmerged", "merged"))
    assert np.abs(unmerged - merged).max() <= 2
    assert pictures["unmerged"].text["lora_apply"] == '["ink:0.8"]'
    assert json.loads(pictures["unmerged"].text["lora_adapters"])[0]["name"] == "ink"


def test_the_slots_fit_their_byte_budget(pipes, layouts):
    pipe = pipes("distilled")
    slots = AdapterSlots(pipe.config, np.float32, np.asarray)
    slots.load("a", layouts["bfl"])
    one = slots.device_bytes // slots.slots
    slots.limit(int(2.5 * one))
    assert slots.slots == 2 and slots.device_bytes == 2 * one
    bank, rows = slots.prepare([[LoraUse("a", 0.5)]])
    assert sum(a.nbytes for parts in bank.values() for a in parts.values()) == slots.device_bytes
    with pytest.raises(InputError, match="one adapter slot takes"):
        slots.limit(one - 1)
    slots.limit(int(1.5 * one))
    assert slots.slots == 1
    with pytest.raises(InputError, match="one adapter slot takes"):
        slots.load("b", layouts["kohya"])  # rank 12 (block-diagonal q/k/v): slots of rank 16, twice the bytes
    assert slots.names == ("a",)


def test_admission_counts_the_adapter_slots(pipes, layouts):
    pipe = pipes("distilled")
    plain = GenerationRequest(prompt="a red fox", height=48, width=64, num_inference_steps=2)
    run = pipe._resolve(plain, ())
    peak = min(m.peak for m in estimates(pipe, None, run.workload, 4))
    adapted = dataclasses.replace(plain, loras=[("bfl", 1.0)])
    try:
        pipe.memory_limit = peak + pipe.adapters.device_bytes
        pipe.check(adapted)
        pipe.memory_limit -= 1
        with pytest.raises(CannotFitError):
            pipe.check(adapted)
    finally:
        pipe.memory_limit = None
