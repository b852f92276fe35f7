"""Inpainting over loopback with the official openai client: `images.edit(image=..., mask=...)`, OpenAI's
mask convention (fully transparent = repaint), `strength` as an extra field, the source kept encoded
across masks, and the inputs refused with a 400 naming the field."""

import base64
import io

import httpx
import numpy as np
import openai
import PIL.Image
import pytest

from klein.masks import from_alpha
from klein.pipeline.loading import load_pipeline
from tests.support.pictures import ellipse_mask, picture

STEPS = {"num_inference_steps": 2}
SIZE = (96, 64)


@pytest.fixture(scope="module")
def client(serve_url):
    return openai.OpenAI(base_url=serve_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def as_png(image: PIL.Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def openai_mask(box) -> PIL.Image.Image:
    """OpenAI's kind of mask: the source's size, opaque everywhere but a transparent ellipse."""
    alpha = PIL.Image.eval(ellipse_mask(*SIZE, box, blur=0), lambda v: 255 - v)
    mask = PIL.Image.new("RGBA", SIZE, (255, 255, 255, 255))
    mask.putalpha(alpha)
    return mask


def decoded(response) -> np.ndarray:
    return np.asarray(PIL.Image.open(io.BytesIO(base64.b64decode(response.data[0].b64_json))).convert("RGB"))


def test_edit_with_a_mask_equals_the_python_call(client, klein_home, monkeypatch):
    source, mask = picture(*SIZE, 0), openai_mask((0.2, 0.2, 0.7, 0.8))
    response = client.images.edit(
        image=("source.png", as_png(source), "image/png"),
        mask=("mask.png", as_png(mask), "image/png"),
        prompt="a hat",
        extra_body={"seed": 4, "strength": 0.7, **STEPS},
    )
    settings = response.model_extra["klein"]["settings"]
    assert settings["strength"] == 0.7 and (settings["width"], settings["height"]) == SIZE
    monkeypatch.setenv("KLEIN_HOME", str(klein_home))
    want = load_pipeline("demo")(
        "a hat", image=source, mask_image=from_alpha(mask), strength=0.7, seed=4, **STEPS
    ).images[0]
    assert np.abs(decoded(response).astype(int) - np.asarray(want, int)).max() <= 1


def test_a_new_mask_on_the_same_source_reuses_its_encoding(client):
    source = as_png(picture(*SIZE, 1))
    runs = [
        client.images.edit(
            image=("source.png", source, "image/png"),
            mask=("mask.png", as_png(openai_mask(box)), "image/png"),
            prompt="a scarf",
            extra_body={"seed": 2, **STEPS},
        )
        for box in ((0.1, 0.1, 0.5, 0.5), (0.4, 0.3, 0.9, 0.9))
    ]
    first, second = (run.model_extra["klein"] for run in runs)
    assert first["references"]["id"] == second["references"]["id"]
    assert second["references"]["cache"] == "hit"
    assert first["settings"]["strength"] == 0.8  # the default with a mask
    assert not np.array_equal(decoded(runs[0]), decoded(runs[1]))


@pytest.mark.parametrize(
    "mask,extra,words",
    [
        (PIL.Image.new("L", SIZE, 0), {}, "all black"),
        (PIL.Image.new("RGBA", SIZE, (0, 0, 0, 255)), {}, "all black"),  # opaque: nothing transparent
        (None, {"strength": 1.5}, "strength"),
        (None, {"strength": 0.0}, "no denoising step"),
        # OpenAI's API refuses a mask of another size (Python resizes it, as diffusers does).
        (PIL.Image.new("L", (96, 96), 255), {}, "the mask is 96x96 px but the image to repaint is 96x64 px"),
    ],
)
def test_bad_inpainting_inputs_are_400s_that_say_why(serve_url, mask, extra, words):
    files = [("image", ("source.png", as_png(picture(*SIZE, 0)), "image/png"))]
    if mask is not None:
        files.append(("mask", ("mask.png", as_png(mask), "image/png")))
    data = {"prompt": "a hat", **{key: str(value) for key, value in {**STEPS, **extra}.items()}}
    response = httpx.post(serve_url + "/v1/images/edits", files=files, data=data, timeout=120)
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]["message"]


def test_strength_without_an_image_is_a_400(serve_url):
    body = {"prompt": "a hat", "size": "64x64", "strength": 0.5, **STEPS}
    response = httpx.post(serve_url + "/v1/images/generations", json=body, timeout=120)
    assert response.status_code == 400
    assert "strength needs the image to repaint" in response.json()["error"]["message"]
