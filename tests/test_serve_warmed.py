"""A warmed server after its warm-up (in process: `klein.serve.service.Service` over the demo checkpoint): a
repaint on a shape compiled behind the requests builds nothing in front of it; the warm-up keeps to itself
the demo's note on inpainting, which a person's inpainting then gets."""

import asyncio
import io
import time
import warnings

import PIL.Image
import pytest

from klein import GenerationRequest
from klein.pipeline import warmup
from klein.pipeline.loading import load_pipeline
from klein.serve import uploads
from klein.serve.generation import Generation
from klein.serve.options import ServeOptions
from klein.serve.service import Service
from tests.support.pictures import picture

NOTE = "cannot show inpainting keeping the unmasked area"
WARM = warmup.shapes(1, height=64, width=128)
"""No references, one, an inpainting of one: 128x64 px, 32 tokens each."""


@pytest.fixture(scope="module")
def warmed(klein_home):
    """(the service, the warnings said during its warm-up)."""
    pipe = load_pipeline()
    pipe.set_progress_bar_config(disable=True)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        service = Service(pipe, ServeOptions(), "test", warm=WARM)
        deadline = time.monotonic() + 300
        while service.warming and time.monotonic() < deadline:
            time.sleep(0.1)
    assert service.warmed
    yield service, [str(warning.message) for warning in said]
    service.worker.stop()
    service.worker.join()


def repaint(service: Service, seed: int, strength: float, mask: PIL.Image.Image | None = None):
    """A repaint of a 64x64 source, as POST /v1/images/edits submits it: (the response, the job's events)."""
    buffer = io.BytesIO()
    picture(64, 64, seed).save(buffer, format="PNG")
    images = asyncio.run(uploads.prepare([buffer.getvalue()], service.options, True, mask))
    request = GenerationRequest(prompt=f"a boat {seed}", seed=seed, strength=strength, mask_image=mask)
    job = asyncio.run(service.submit_generation(Generation(request, tuple(images))))
    return job.future.result(300), job.events


def test_a_repaint_on_a_shape_compiled_behind_compiles_nothing_in_front(warmed):
    service, _ = warmed
    first, _ = repaint(service, 1, 0.8)  # its own shape cold: on the warm 32 tokens, its own compiled behind
    assert first["klein"]["buckets"]["larger"]
    service.pipe.warm_buckets.drain(300)
    mask = PIL.Image.new("L", (64, 64), 0)
    mask.paste(255, (0, 0, 32, 64))
    for seed, strength, masked in ((2, 0.8, mask), (3, 0.8, None)):
        answer, events = repaint(service, seed, strength, masked)
        assert not answer["klein"]["buckets"]["larger"]  # on the shape compiled behind
        assert answer["klein"]["timings"]["compile"] == 0.0, (answer["klein"], events)
        assert [data for name, data in events if name == "stage" and data["compiling"]] == []


def test_the_warm_up_says_nothing_of_inpainting_a_persons_inpainting_does(warmed):
    service, said = warmed
    assert [line for line in said if NOTE in line] == []
    mask = PIL.Image.new("L", (64, 64), 0)
    mask.paste(255, (0, 0, 64, 32))
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        answer, _ = repaint(service, 4, 0.8, mask)
    assert [line for line in answer["klein"]["warnings"] if NOTE in line]  # in the response, as always
    assert [warning for warning in later if NOTE in str(warning.message)]  # and in the server's log
