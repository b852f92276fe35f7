"""Nothing recompiles in the interactive loop: after a mode's first request, requests that vary only what
is data (prompt and its length, seed, steps, guidance, strength, the mask's pixels, the references' pixels,
LoRA scales, the models moving on and off the device under `sequential`) build no program; and a warmed
pipeline builds none for the shapes it warmed."""

import numpy as np
import PIL.Image
import pytest

from klein.pipeline import warmup
from klein.pipeline.compilations import Compilations
from klein.pipeline.flux2_klein import load_pipeline
from tests.support import lora_files as lf

SIZE = dict(height=64, width=64)
LONG = " ".join(
    ["a lighthouse on a cliff at dusk, waves below, gulls above"] * 40
)  # past the encoder's limit


def _picture(seed: int) -> PIL.Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (64, 64, 3), np.uint8)
    return PIL.Image.fromarray(pixels)


def _mask(rows: slice) -> PIL.Image.Image:
    mask = np.zeros((64, 64), np.uint8)
    mask[rows] = 255
    return PIL.Image.fromarray(mask)


def _quiet(pipe):
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def demo(klein_home):
    """The demo checkpoint (KV, distilled), its text encoder and transformer taking turns on the device."""
    pipe = _quiet(load_pipeline(residency="sequential"))
    assert pipe.residency == "sequential"
    return pipe


@pytest.fixture(scope="module")
def base(tiny_pipelines):
    """A base (CFG) checkpoint, every model resident."""
    folder, _ = tiny_pipelines("base")
    return _quiet(load_pipeline(folder, residency="all"))


def _varied(first: dict, *changes: dict) -> list[dict]:
    return [first] + [{**first, **change} for change in changes]


PROMPTS = ({"prompt": "a fox"}, {"prompt": LONG, "seed": 2}, {"prompt": "a red fox in snow", "seed": 3})

LOOPS = {
    "text-to-image": _varied(
        dict(prompt="a cat", seed=1, num_inference_steps=2, **SIZE), *PROMPTS, {"num_inference_steps": 3}
    ),
    "references": _varied(
        dict(prompt="a cat", image=[_picture(0)], use_kv=False, seed=1, num_inference_steps=2),
        *PROMPTS,
        {"image": [_picture(1)]},
    ),
    "kv": _varied(
        dict(prompt="a cat", image=[_picture(0), _picture(1)], seed=1, num_inference_steps=2),
        *PROMPTS,
        {"image": [_picture(2), _picture(3)], "num_inference_steps": 3},
    ),
    "inpainting": _varied(
        dict(
            prompt="a cat", image=[_picture(0)], mask_image=_mask(slice(0, 32)), num_inference_steps=4, seed=1
        ),
        *PROMPTS,
        {"mask_image": _mask(slice(16, 64)), "strength": 0.5},
        {"image": [_picture(1)], "strength": 0.9},
    ),
}


@pytest.mark.parametrize("mode", LOOPS)
def test_only_the_first_request_of_a_mode_compiles(demo, mode):
    first, *rest = LOOPS[mode]
    demo(**first)
    for request in rest:
        with Compilations() as built:
            demo(**request)
        assert built.names == [], f"{mode}: {request} compiled {built.names}"


def test_cfg_guidance_and_lora_scales_compile_nothing(base, tmp_path):
    shapes = lf.linear_shapes(base.config, "diffusers")
    lora = lf.write_peft(tmp_path / "lora.safetensors", lf.random_lora(shapes, 4, 1))
    request = dict(prompt="a cat", seed=1, num_inference_steps=2, guidance_scale=4.0, **SIZE)
    base.set_loras([(lora, 0.5)])  # the first merge builds its programs; a new scale is data
    assert base(**request).settings.mode.guided
    for change, scale in (({"guidance_scale": 2.5}, 1.5), ({"prompt": LONG}, 0.25), ({"seed": 9}, 1.0)):
        with Compilations() as built:
            base.set_loras([(lora, scale)])
            base(**{**request, **change})
        assert built.names == [], f"{change}, LoRA scale {scale}: compiled {built.names}"
    base.set_loras([])


def test_a_warmed_pipeline_compiles_nothing_for_what_it_warmed(demo):
    planned = warmup.shapes(references=1, batches=(1, 2), height=64, width=96)
    warmed = warmup.warm(demo, planned)
    assert warmed > 0  # a size no other test met
    source = PIL.Image.new("RGB", (96, 64), (10, 200, 30))
    mask = PIL.Image.new("L", (96, 64), 0)
    mask.paste(255, (0, 0, 48, 64))
    requests = [
        dict(prompt="a boat", height=64, width=96, seed=5),
        dict(prompt="two boats", height=64, width=96, num_images_per_prompt=2, seed=6),
        dict(prompt=LONG, image=[source], seed=7),
        dict(prompt="a boat", image=[source], mask_image=mask, strength=0.7, seed=8),
    ]
    with Compilations() as built:
        for request in requests:
            demo(**request)
    assert built.names == []
