"""Nothing recompiles in the interactive loop: after a mode's first request, requests that vary only what
is data (prompt and its length, seed, steps, guidance, strength, the mask's pixels, the references'
pixels, LoRA scales, the models moving on and off the device under `sequential`, layers streamed under
`stream`) build no program; and a warmed pipeline, or server, builds none for the shapes it warmed (a
server answering /healthz 503 "warming" until then); `klein plan` counts the programs an editing run meets."""

import asyncio
import threading
import time

import jax
import numpy as np
import PIL.Image
import pytest
from starlette.testclient import TestClient

from klein import GenerationRequest
from klein.cli.main import main
from klein.cli.serve import serve_parser, warm_shapes
from klein.errors import InputError
from klein.images import prepare_reference
from klein.pipeline import bucket_fit, warmup
from klein.pipeline.compilations import Compilations
from klein.pipeline.loading import load_pipeline
from klein.serve.app import create_app
from klein.serve.generation import Generation
from klein.serve.options import ServeOptions
from klein.serve.reference_sets import PreparedImage
from klein.serve.service import Service
from tests.support import lora_files as lf

pytestmark = pytest.mark.filterwarnings("ignore:prompt .* were cut")  # LONG: a prompt past the limit

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
        dict(prompt="a cat", seed=1, num_inference_steps=2, **SIZE),
        *PROMPTS,
        {"num_inference_steps": 3},
        {"sigmas": [1.0, 0.6, 0.3]},  # a schedule of one's own is data too
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


def test_layers_streamed_from_host_memory_compile_nothing_after_the_first_edit(klein_home):
    pipe = _quiet(load_pipeline(residency="stream"))
    first, *rest = LOOPS["kv"]
    pipe(**first)
    with Compilations() as built:
        for request in rest:
            pipe(**request)
    assert built.names == []


def test_weights_back_from_host_memory_compile_nothing(klein_home):
    """As on a GPU: `sequential` keeps the model it moves off in pinned host memory and brings it back."""
    pipe = _quiet(load_pipeline(residency="sequential"))
    for model in pipe._models.values():  # CPU's pinned_host memory standing in for a GPU's
        model.keep_host = True
    first, *rest = LOOPS["kv"]
    pipe(**first)
    with Compilations() as built:
        for request in rest:  # each new prompt brings the text encoder back, then the transformer
            pipe(**request)
    assert pipe._models["text_encoder"].reads == 1  # back from host memory, not read again
    assert built.names == []


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
    jax.clear_caches()  # as in a new process: pipelines of one model share their programs in this one
    warmed = warmup.warm(demo, planned)
    assert warmed > 0
    source = PIL.Image.new("RGB", (96, 64), (10, 200, 30))
    mask = PIL.Image.new("L", (96, 64), 0)
    mask.paste(255, (0, 0, 48, 64))
    requests = [
        dict(prompt="a boat", height=64, width=96, seed=5),
        dict(prompt="two boats", height=64, width=96, num_images_per_prompt=2, seed=6),
        # Two prompts of an image each, as a server's batch of two separate requests runs them.
        dict(prompt=["a boat", "a kite"], height=64, width=96, seed=9),
        dict(prompt=LONG, image=[source], seed=7),
        dict(prompt="a boat", image=[source], mask_image=mask, strength=0.7, seed=8),
    ]
    with Compilations() as built:
        for request in requests:
            demo(**request)
    assert built.names == []


def test_the_sizes_of_a_canvas_class_share_the_vaes_programs(demo):
    """A pipeline never warmed runs the VAE on its size's class of canvas (`vae_canvas.canvas_size`):
    48x80 and 64x112 px share the 64x128 canvas's encoder and decoder, 80x80 builds a decoder of its own
    (128x128); each comes back at its own size."""
    jax.clear_caches()  # as in a new process: pipelines of one model share their programs in this one
    token, channels = demo.vae_config.pixels_per_token, demo.config.in_channels
    rng = np.random.default_rng(0)

    def decoder_built(rows: int, columns: int) -> int:
        latents = rng.standard_normal((1, rows, columns, channels)).astype(np.float32)
        with Compilations() as built:
            pixels = bucket_fit.decode(demo, latents)
        assert pixels.shape == (1, rows * token, columns * token, 3)
        return built.names.count("jit(decode_latents_on_canvas)")

    def encoder_built(rows: int, columns: int) -> int:
        with Compilations() as built:
            latents = demo.encode_reference_latents(
                rng.random((rows * token, columns * token, 3), np.float32)
            )
        assert latents.shape == (rows, columns, channels)
        return built.names.count("jit(encode_latents_on_canvas)")

    assert [decoder_built(*size) for size in ((3, 5), (4, 7), (5, 5))] == [1, 0, 1]
    assert [encoder_built(*size) for size in ((3, 5), (4, 7))] == [1, 0]


def test_a_shape_that_cannot_fit_is_skipped_and_said(demo, monkeypatch):
    monkeypatch.setattr(demo, "memory_limit", 1024)
    lines = []
    assert warmup.warm(demo, warmup.shapes(1, height=64, width=64), lines.append) == 0
    assert len(lines) == 3 and all("skipped" in line and "memory_limit" in line for line in lines)


def test_a_server_warms_before_it_is_ready_then_builds_nothing_for_those_shapes(demo, monkeypatch):
    release, warm = threading.Event(), warmup.warm
    monkeypatch.setattr(warmup, "warm", lambda *args: release.wait(60) and warm(*args))
    service = Service(demo, ServeOptions(), "test", warm=warmup.shapes(1, (1,), height=64, width=128))
    client = TestClient(create_app(service), base_url="http://127.0.0.1")
    try:
        health = client.get("/healthz")
        assert (health.status_code, health.json()["status"]) == (503, "warming")
        assert client.get("/v1/config").json()["warming"]
        release.set()
        deadline = time.monotonic() + 120
        while service.warming and time.monotonic() < deadline:
            time.sleep(0.1)
        health = client.get("/healthz")
        assert (health.status_code, health.json()["status"]) == (200, "ok")
        assert client.get("/v1/config").json()["warmed"]
        picture = prepare_reference(PIL.Image.new("RGB", (128, 64), (200, 30, 30)))
        work = Generation(GenerationRequest(prompt="a kite", seed=4), (PreparedImage.of(picture),))
        with Compilations() as built:
            job = asyncio.run(service.submit_generation(work))
            assert len(job.future.result(120)["data"]) == 1
        assert built.names == []
    finally:
        service.worker.stop()
        service.worker.join()


def test_klein_serve_warms_its_limits_at_the_size_asked_or_nothing():
    parser = serve_parser()
    flags = parser.parse_args("--warm-size 128x64 --max-references 2 --max-batch 2".split())
    options = ServeOptions(max_references=2, max_batch=2)
    assert warm_shapes(flags, options) == (
        *(warmup.Shape(n, height=64, width=128) for n in range(3)),
        warmup.Shape(0, 2, height=64, width=128),
        warmup.Shape(1, 2, height=64, width=128),
        warmup.Shape(1, repaint=True, height=64, width=128),
    )
    assert warm_shapes(parser.parse_args(["--no-warm"]), options) == ()
    with pytest.raises(InputError, match="--warm-size: .*multiple of 16"):
        parser.parse_args(["--warm-size", "100x64"])
    # Several sizes: those of another's token buckets warm nothing more (64x128: 32 tokens; 80x80: 25,
    # padded to 32, and its references' 50 to 64 as 128x64's two); 96x96's 36 tokens pad to 48.
    flags = parser.parse_args(
        "--warm-size 128x64,64x128,80x80,96x96 --max-references 2 --max-batch 2".split()
    )
    planned = warm_shapes(flags, options)
    assert [(s.width, s.height) for s in planned] == [(128, 64)] * 6 + [(96, 96)] * 6
    assert [s.streams.image for s in planned] == [32] * 6 + [48] * 6
    assert len({s.programs for s in planned}) == 12


def test_klein_plan_counts_the_programs_an_editing_run_meets(capsys):
    assert main(["plan", "--refs", "2"]) == 0  # the demo: a KV checkpoint, a prefill per reference count
    shown = capsys.readouterr().out
    assert (
        "meets 8 large programs (text encoder 1, reference encoder 1, prefill 2, step 3, decoder 1)" in shown
    )


def test_a_pipeline_offering_loras_warms_them_so_the_first_request_naming_one_builds_nothing(demo, tmp_path):
    """`--lora-dir` / `--lora-named`: warming runs each shape under a LoRA too (the step and the prefill
    take the adapter slots as arguments: programs of their own), so neither a LoRA's first request, nor
    another LoRA's, nor an edit under one, compiles."""
    shapes, pipe = lf.linear_shapes(demo.config, "bfl"), _quiet(load_pipeline(residency="sequential"))
    for seed, name in enumerate(("ink", "oil")):  # as `klein serve --lora-dir` loads them
        pipe.load_lora(name, lf.write_bfl(tmp_path / f"{name}.safetensors", lf.random_lora(shapes, 4, seed)))
    size = dict(height=64, width=96)  # the plain programs are in the persistent cache after the test above
    assert warmup.warm(pipe, warmup.shapes(1, (1,), **size)) > 0
    source = PIL.Image.new("RGB", (96, 64), (10, 200, 30))
    requests = [
        dict(prompt="a boat", loras=[("oil", 0.7)], seed=1),
        dict(prompt=LONG, loras=["ink"], seed=2),
        dict(prompt="a boat", image=[source], loras=["ink:0.5", "oil:0.2"], seed=3),
    ]
    with Compilations() as built:
        for request in requests:
            pipe(**request, **size)
    assert built.names == []
