"""klein's ComfyUI nodes (integrations/comfyui) inside a real ComfyUI, headless on the CPU, against a
`klein serve` of the demo checkpoint: the docs' API-format workflows submitted to ComfyUI's /prompt give the
PNGs klein serve gives for the same request, steps reach ComfyUI's progress bar, a reference set is
uploaded once for the same images, and klein's error is ComfyUI's execution_error.

ComfyUI runs from its own environment (tests/comfyui/install.sh; CI makes it and sets
KLEIN_COMFYUI_REQUIRED=1, so that there a broken install fails these tests instead of skipping them)."""

import base64
import io
import json
import os

import httpx
import numpy as np
import PIL.Image
import pytest

from klein.io import demo
from klein.models.transformer_config import TransformerConfig
from tests.support import comfyui_process as comfy
from tests.support import lora_files as lf
from tests.support import serve_process
from tests.support.pictures import ellipse_mask, picture

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not comfy.installed() and not os.environ.get("KLEIN_COMFYUI_REQUIRED"),
        reason="ComfyUI's environment is not installed here: bash tests/comfyui/install.sh (CI does)",
    ),
]
SIDE, STEPS = 64, 2


@pytest.fixture(scope="module")
def servers(klein_home, tmp_path_factory):
    """(klein serve URL, ComfyUI URL, ComfyUI's base directory): klein serve offering one LoRA, "ink", and
    ComfyUI with the node pack and two input pictures, cat.png and room.png (transparent in an ellipse)."""
    base = tmp_path_factory.mktemp("comfyui")
    (base / "input").mkdir()
    picture(SIDE, SIDE, 1).save(base / "input" / "cat.png")
    room = picture(SIDE, SIDE, 2).convert("RGBA")
    room.putalpha(PIL.Image.eval(ellipse_mask(SIDE, SIDE, (0.2, 0.3, 0.7, 0.8), blur=0), lambda v: 255 - v))
    room.save(base / "input" / "room.png")
    loras = tmp_path_factory.mktemp("comfyui-loras")
    shapes = lf.linear_shapes(TransformerConfig.from_diffusers(demo.TRANSFORMER), "bfl")
    lf.write_bfl(loras / "ink.safetensors", lf.random_lora(shapes, 4, 2))
    process, comfy_url = comfy.start(base)  # ComfyUI starts while klein serve does
    try:
        with serve_process.running(klein_home, "--lora-dir", str(loras)) as klein_url:
            comfy.wait_ready(process, comfy_url)
            yield klein_url, comfy_url, base
    finally:
        comfy.stop(process)


def _workflow(name: str, klein_url: str, node: str, **inputs) -> dict:
    workflow = comfy.workflow(name)
    workflow["1"]["inputs"]["url"] = klein_url
    workflow[node]["inputs"] |= inputs
    return workflow


def _saved(entry: dict, base, node: str) -> np.ndarray:
    assert entry["status"]["status_str"] == "success", entry["status"]
    (image,) = entry["outputs"][node]["images"]
    path = base / "output" / image["subfolder"] / image["filename"]
    return np.asarray(PIL.Image.open(path).convert("RGB"), np.int32)


def _png(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    data = base64.b64decode(response.json()["data"][0]["b64_json"])
    return np.asarray(PIL.Image.open(io.BytesIO(data)).convert("RGB"), np.int32)


def _file(path) -> bytes:
    return path.read_bytes()


def _as_png(image: PIL.Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _same(got: np.ndarray, want: np.ndarray) -> None:
    # ComfyUI's SaveImage truncates 255 * x where klein rounds: a level apart at most.
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1, f"differ by up to {np.abs(got - want).max()} levels"
    assert got.std() > 10, "a blank image"


def _generate(klein_url: str, **fields) -> np.ndarray:
    body = {"prompt": "a fox", "size": f"{SIDE}x{SIDE}", "seed": 7, "num_inference_steps": STEPS} | fields
    return _png(httpx.post(klein_url + "/v1/images/generations", json=body, timeout=120))


def test_generate_equals_klein_serve_and_shows_progress(servers):
    klein_url, comfy_url, base = servers
    settings = {"prompt": "a fox", "width": SIDE, "height": SIDE, "seed": 7, "steps": STEPS}
    entry, progress = comfy.run(comfy_url, _workflow("klein_generate", klein_url, "2", **settings))
    _same(_saved(entry, base, "3"), _generate(klein_url))
    steps = [(message["value"], message["max"]) for message in progress if message["node"] == "2"]
    assert steps == [(1, STEPS), (2, STEPS)]


def test_a_lora_by_name(servers):
    klein_url, comfy_url, base = servers
    settings = {
        "prompt": "a fox",
        "width": SIDE,
        "height": SIDE,
        "seed": 7,
        "steps": STEPS,
        "loras": "ink:0.9",
    }
    entry, _ = comfy.run(comfy_url, _workflow("klein_generate", klein_url, "2", **settings))
    got = _saved(entry, base, "3")
    _same(got, _generate(klein_url, loras=["ink:0.9"]))
    moved = np.abs(got - _generate(klein_url)).mean()
    assert moved > 5, f"the LoRA moved the image by only {moved:.2f} / 255"


def _jobs_done(klein_url: str) -> float:
    return serve_process.metrics(klein_url).get('klein_jobs_total{status="done"}', 0.0)


def test_edit_uploads_the_reference_set_once(servers):
    klein_url, comfy_url, base = servers
    before = _jobs_done(klein_url)
    first, _ = comfy.run(
        comfy_url, _workflow("klein_edit", klein_url, "3", prompt="a hat", seed=1, steps=STEPS)
    )
    second, _ = comfy.run(
        comfy_url, _workflow("klein_edit", klein_url, "3", prompt="a hat", seed=2, steps=STEPS)
    )
    # One upload (a job of its own: POST /v1/references) and two generations naming its id.
    assert _jobs_done(klein_url) - before == 3
    fields = {"prompt": "a hat", "size": "auto", "seed": "1", "num_inference_steps": str(STEPS)}
    files = [("image[]", ("cat.png", _file(base / "input" / "cat.png"), "image/png"))]
    direct = httpx.post(klein_url + "/v1/images/edits", data=fields, files=files, timeout=120)
    _same(_saved(first, base, "4"), _png(direct))
    assert np.abs(_saved(second, base, "4") - _png(direct)).mean() > 5, "seed 2 gave seed 1's image"


def test_inpaint_with_loadimage_mask(servers):
    klein_url, comfy_url, base = servers
    settings = {"prompt": "a chair", "seed": 3, "steps": STEPS, "strength": 1.0}
    entry, _ = comfy.run(comfy_url, _workflow("klein_inpaint", klein_url, "3", **settings))
    fields = {"prompt": "a chair", "seed": "3", "num_inference_steps": str(STEPS), "strength": "1.0"}
    files = [
        ("image", ("room.png", _as_png(picture(SIDE, SIDE, 2)), "image/png")),
        ("mask", ("mask.png", _file(base / "input" / "room.png"), "image/png")),  # OpenAI's: transparent
    ]
    direct = _png(httpx.post(klein_url + "/v1/images/edits", data=fields, files=files, timeout=120))
    got = _saved(entry, base, "4")
    _same(got, direct)
    # The mask is read as klein reads it: the other area repainted gives another image.
    other = PIL.Image.open(base / "input" / "room.png")
    other.putalpha(PIL.Image.eval(other.getchannel("A"), lambda v: 255 - v))
    files[1] = ("mask", ("mask.png", _as_png(other), "image/png"))
    inverted = _png(httpx.post(klein_url + "/v1/images/edits", data=fields, files=files, timeout=120))
    assert np.abs(got - inverted).mean() > 5, "the mask made no difference"


def _error(entry: dict) -> dict:
    assert entry["status"]["status_str"] == "error", entry["status"]
    (error,) = [data for name, data in entry["status"]["messages"] if name == "execution_error"]
    return error


def test_klein_errors_are_comfyui_execution_errors(servers):
    klein_url, comfy_url, _ = servers
    settings = {"prompt": "a fox", "width": SIDE, "height": SIDE, "steps": STEPS, "loras": "nope"}
    entry, _ = comfy.run(comfy_url, _workflow("klein_generate", klein_url, "2", **settings))
    body = {"prompt": "a fox", "size": f"{SIDE}x{SIDE}", "loras": ["nope"], "num_inference_steps": STEPS}
    answer = httpx.post(klein_url + "/v1/images/generations", json=body, timeout=120)
    assert answer.status_code == 400
    error = _error(entry)
    assert error["node_type"] == "KleinGenerate" and error["exception_type"].endswith("KleinError")
    assert error["exception_message"].rstrip("\n") == answer.json()["error"]["message"]  # ComfyUI adds a \n
    assert error["exception_message"].startswith(
        "loras: no LoRA named 'nope' is offered"
    )  # as docs/comfyui.md says
    closed = f"http://127.0.0.1:{serve_process.free_port()}"
    entry, _ = comfy.run(comfy_url, _workflow("klein_generate", closed, "2", **settings))
    assert _error(entry)["exception_message"].startswith(f"cannot reach klein serve at {closed}: ")


def test_the_docs_workflows_name_only_real_inputs(servers):
    """Every input the committed workflows set is one the node declares (a renamed input fails here)."""
    _, comfy_url, _ = servers
    for name in ("klein_generate", "klein_edit", "klein_inpaint"):
        for node in comfy.workflow(name).values():
            info = httpx.get(f"{comfy_url}/object_info/{node['class_type']}", timeout=10).json()
            declared = info[node["class_type"]]["input"]
            names = {**declared["required"], **declared.get("optional", {})}
            assert set(node["inputs"]) <= set(names), (name, node["class_type"], json.dumps(node["inputs"]))
