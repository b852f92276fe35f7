"""`klein serve --lora`: the served images carry the LoRA (metadata, settings) and differ from the base's."""

import base64
import hashlib
import io
import json

import httpx
import numpy as np
import PIL.Image

from klein.io import demo
from klein.models.transformer_config import TransformerConfig
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


def test_served_images_carry_the_lora(klein_home, serve_url, tmp_path):
    shapes = lf.linear_shapes(TransformerConfig.from_diffusers(demo.TRANSFORMER), "bfl")
    file = lf.write_kohya(tmp_path / "style.safetensors", lf.random_lora(shapes, 4, 1), alpha=4.0)
    recorded = [{"name": str(file), "scale": 0.8, "sha256": hashlib.sha256(file.read_bytes()).hexdigest()}]
    with serve_process.running(klein_home, "--lora", f"{file}:0.8") as url:
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
