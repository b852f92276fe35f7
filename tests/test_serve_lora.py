"""`klein serve --lora`: the served images carry the merged LoRA (metadata, settings) and differ from the
base's. `--lora-dir` / `--lora-named`: requests name the LoRAs the operator offers (`/v1/loras`), each
applied to its own images on the same server, over loopback with the openai client; a name that is a path,
or that the server does not offer, is refused with a 400."""

import base64
import hashlib
import io
import json

import httpx
import numpy as np
import openai
import PIL.Image
import pytest

from klein.io import demo
from klein.models.transformer_config import TransformerConfig
from klein.request.request import GenerationRequest
from klein.serve import batching
from klein.serve.generation import Generation
from tests.support import lora_files as lf
from tests.support import serve_process
from tests.test_cli import run_klein

BODY = {"prompt": "a fox", "size": "64x64", "seed": 3, "num_inference_steps": 2}


def _generate(url: str) -> tuple[PIL.Image.Image, dict]:
    response = httpx.post(url + "/v1/images/generations", json=BODY, timeout=120)
    assert response.status_code == 200, response.text
    body = response.json()
    return PIL.Image.open(io.BytesIO(base64.b64decode(body["data"][0]["b64_json"]))), body["klein"][
        "settings"
    ]


@pytest.fixture(scope="module")
def served(klein_home, tmp_path_factory):
    """(URL, merged LoRA file, offered LoRA files by name) of one `klein serve` with a LoRA merged and
    three offered by name: two from a folder, one named."""
    folder = tmp_path_factory.mktemp("served-loras")
    shapes = lf.linear_shapes(TransformerConfig.from_diffusers(demo.TRANSFORMER), "bfl")
    merged = lf.write_kohya(folder / "style.safetensors", lf.random_lora(shapes, 4, 1), alpha=4.0)
    offered = folder / "offered"
    offered.mkdir()
    files = {
        "ink": lf.write_bfl(offered / "ink.safetensors", lf.random_lora(shapes, 4, 2)),
        "pen": lf.write_bfl(offered / "pen.safetensors", lf.random_lora(shapes, 8, 3)),
        "wash": lf.write_kohya(folder / "w.safetensors", lf.random_lora(shapes, 4, 4), alpha=4.0),
    }
    flags = ("--lora", f"{merged}:0.8", "--lora-dir", str(offered), "--lora-named", f"wash={files['wash']}")
    with serve_process.running(klein_home, *flags, "--max-batch", "4") as url:
        yield url, merged, files


def test_served_images_carry_the_lora(served, serve_url):
    url, file, _ = served
    recorded = [{"name": str(file), "scale": 0.8, "sha256": hashlib.sha256(file.read_bytes()).hexdigest()}]
    image, settings = _generate(url)
    base, base_settings = _generate(serve_url)
    assert settings["loras"] == recorded and base_settings["loras"] == []
    assert json.loads(image.text["loras"]) == recorded and "loras" not in base.text
    moved = np.abs(np.asarray(image, np.float32) - np.asarray(base, np.float32)).mean()
    assert moved > 5.0, f"the LoRA moved the image by only {moved:.2f} / 255 on average"


def test_a_bad_lora_stops_serve_before_it_listens(klein_home, tmp_path):
    port = str(serve_process.free_port())
    result = run_klein(
        klein_home, "serve", "--port", port, "--lora", tmp_path / "missing.safetensors", cwd=tmp_path
    )
    assert result.returncode == 2 and "error: LoRA" in result.stderr and "Traceback" not in result.stderr


def _sha(file) -> str:
    return hashlib.sha256(file.read_bytes()).hexdigest()


def test_offered_loras_are_listed(served):
    url, _, files = served
    listed = httpx.get(url + "/v1/loras", timeout=10).json()
    assert {entry["name"]: entry["sha256"] for entry in listed["data"]} == {
        n: _sha(f) for n, f in files.items()
    }
    assert listed["slots"] == 4 and listed["rank"] == 8


def test_alternating_loras_over_the_openai_client(served):
    url, _, files = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    pictures = {}
    for name in ("ink", "pen", "ink", "pen"):
        response = client.images.generate(
            prompt="a fox",
            size="64x64",
            extra_body={"seed": 3, "num_inference_steps": 2, "loras": [{"name": name, "scale": 0.9}]},
        )
        image = PIL.Image.open(io.BytesIO(base64.b64decode(response.data[0].b64_json)))
        ran = [{"name": name, "scale": 0.9, "sha256": _sha(files[name])}]
        assert response.model_extra["klein"]["settings"]["lora_adapters"] == ran
        assert json.loads(image.text["lora_adapters"]) == ran
        pixels = np.asarray(image, np.float32)
        if name in pictures:  # the same LoRA gives the same image, whichever ran in between
            assert np.abs(pixels - pictures[name]).max() <= 1.0
        pictures[name] = pixels
    moved = np.abs(pictures["ink"] - pictures["pen"]).mean()
    assert moved > 5.0, f"the two LoRAs differ by only {moved:.2f} / 255 on average"


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("../ink", "is a path"),
        ("/etc/passwd", "is a path"),
        ("offered/ink.safetensors", "is a path"),
        ("~root", "is a path"),
        ("C:\\x", "is a path"),
        ("sketch", "no LoRA named 'sketch' is offered (offered: ink, pen, wash); GET /v1/loras lists"),
        ("inc", "no LoRA named 'inc' is offered; did you mean 'ink'?"),
    ],
)
def test_names_that_are_paths_or_not_offered_are_refused(served, name, words):
    url, _, _ = served
    body = {**BODY, "loras": [{"name": name, "scale": 1.0}]}
    response = httpx.post(url + "/v1/images/generations", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == "loras" and "pipe.load_lora" not in error["message"]


def test_a_path_field_is_refused(served):
    url, _, files = served
    body = {**BODY, "loras": [{"name": "ink", "path": str(files["ink"])}]}
    response = httpx.post(url + "/v1/images/generations", json=body, timeout=30)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "loras"
    assert "unknown field 'path' in loras[0]: a LoRA is named, never given as a file" in error["message"]


def test_an_edit_names_its_loras_in_a_form_field(served):
    url, _, files = served
    image = ("ref.png", serve_process.png(1), "image/png")
    fields = {"prompt": "a fox", "size": "auto", "seed": "3", "num_inference_steps": "2"}
    edit = httpx.post(
        url + "/v1/images/edits",
        files=[("image", image)],
        data={**fields, "loras": '[{"name": "wash", "scale": 0.5}]'},
        timeout=120,
    )
    assert edit.status_code == 200, edit.text
    ran = edit.json()["klein"]["settings"]["lora_adapters"]
    assert ran == [{"name": "wash", "scale": 0.5, "sha256": _sha(files["wash"])}]
    bad = httpx.post(
        url + "/v1/images/edits", files=[("image", image)], data={**fields, "loras": "wash:x"}, timeout=30
    )
    assert bad.status_code == 400 and "the scale after ':' must be a number" in bad.json()["error"]["message"]


def test_a_batch_naming_more_loras_than_slots_is_split():
    names = [["a", "b"], ["c"], [], ["d"], ["e"], ["a"]]
    works = [Generation(GenerationRequest(prompt="x", loras=uses)) for uses in names]
    assert batching._within_slots(works, 4) == [[0, 1, 2, 3], [4, 5]]
    assert batching._within_slots(works, 2) == [[0], [1, 2, 3], [4, 5]]


def test_requests_batch_across_loras_but_not_across_lora_sets_with_references():
    def key(loras, reference_id=None):
        return Generation(GenerationRequest(prompt="x", loras=loras), reference_id=reference_id).batch_key

    assert key([("ink", 0.8)]) == key([("pen", 1.0)]) == key([])
    assert key([("ink", 0.8)], "set") != key([("pen", 1.0)], "set")
    assert key([("ink", 0.8)], "set") == key(["ink:0.8"], "set")


def test_deleting_a_reference_set_drops_its_entries_under_every_lora_set(served):
    """DELETE /v1/references/{id}: the set's keys and values prefilled under a LoRA go too, so the same
    images uploaded again are encoded again under that LoRA (a "miss"), never served from before."""
    url, _, _ = served
    picture = [("image", ("ref.png", serve_process.png(7), "image/png"))]

    def generate(reference_id: str) -> str:
        body = {**BODY, "references": reference_id, "loras": [{"name": "pen", "scale": 0.6}]}
        response = httpx.post(url + "/v1/images/generations", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()["klein"]["references"]["cache"]

    reference_id = httpx.post(url + "/v1/references", files=picture, timeout=120).json()["id"]
    assert [generate(reference_id), generate(reference_id)] == ["miss", "hit"]
    assert httpx.delete(f"{url}/v1/references/{reference_id}", timeout=30).json()["deleted"]
    assert httpx.post(url + "/v1/references", files=picture, timeout=120).json()["id"] == reference_id
    assert generate(reference_id) == "miss"
