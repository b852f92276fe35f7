"""Requests in the forms and words of each front end: edit sources of any shape refused by klein (not by
Pillow), a batch's jobs each with their own time limit when run alone, and LoRA uses spelt the same way
in Python, `klein batch` lines and HTTP bodies and form fields, each mistake worded for the front end."""

import io
import json
import pickle
import threading
import types

import httpx
import PIL.Image
import pytest

from klein import GenerationRequest, images, masks
from klein.batch import lines
from klein.cli import main as cli
from klein.errors import InputError
from klein.io import demo
from klein.models.transformer_config import TransformerConfig
from klein.pipeline.stage_events import StageEvent
from klein.request import kinds
from klein.request.loras import LoraUse
from klein.serve import schema, uploads
from klein.serve import worker as worker_module
from klein.serve.errors import ApiError
from klein.serve.jobs import JobTable
from klein.serve.metrics import Metrics
from klein.serve.options import ServeOptions
from klein.serve.worker import Worker
from tests.support import lora_files as lf

GOOD = {"prompt": "a fox", "size": "64x64", "num_inference_steps": 2}


def encoded(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    PIL.Image.new("L", (width, height)).save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


def test_a_source_past_the_aspect_limit_is_refused_in_klein_words():
    """16 x 262144 px is within a 2048x2048 px pixel budget; resized to 1024^2 px of area it would be 0 px
    wide, which Pillow refused with a ValueError (a 500 over HTTP)."""
    with pytest.raises(InputError, match=r"16x262144 px .* aspect ratio of 16384.0:1; .* at most 8 times"):
        masks.prepare_source(PIL.Image.new("RGB", (16, 262144)))
    with pytest.raises(ApiError) as raised:
        uploads._prepare_all([encoded(16, 262144)], 2048 * 2048, source=True)
    assert (raised.value.status, raised.value.param) == (400, "image")
    assert "aspect ratio" in raised.value.message


def test_an_upload_past_pillows_guard_gets_klein_size_message(monkeypatch):
    """The server sets Pillow's guard from --max-pixels; Pillow refuses past twice that as it reads the
    header, before klein's check: the message is still klein's, with the size and the limit."""
    monkeypatch.setattr(PIL.Image, "MAX_IMAGE_PIXELS", 1_000_000)
    with pytest.raises(InputError) as raised:
        images.read_image(encoded(3000, 3000), "image 1", 1_000_000, formats=images.UPLOAD_FORMATS)
    message = str(raised.value)
    assert message == "image 1 is 3000x3000 px, more than the 1000x1000 px allowed; send a smaller image"
    assert "decompression" not in message


def test_a_job_run_alone_after_its_batch_failed_gets_its_own_time_limit(monkeypatch):
    """One client cancels its job in a batch, which ends the batch; the other job, run alone, has its
    whole --job-timeout from when it starts alone, not what the batch left of it."""
    clock = types.SimpleNamespace(now=0.0)  # the worker's clock, moved only by the fake work below
    read = lambda: clock.now  # noqa: E731
    monkeypatch.setattr(worker_module, "time", types.SimpleNamespace(monotonic=read, perf_counter=read))
    limit, hold = 2.0, threading.Event()

    def batch(jobs):
        clock.now += 0.8 * limit  # most of the limit, then a cancel ends the batch
        worker.cancel(jobs[0])
        for job in jobs:
            job.step(StageEvent("denoise", 1, 4))
        return [{"data": []} for _ in jobs]

    def alone(job):
        clock.now += 0.8 * limit  # within the limit on its own
        job.step(StageEvent("denoise", 1, 4))
        return {"data": ["alone"]}

    worker = Worker(8, Metrics(), JobTable(2**30, 60), 4, batch, limit, first=lambda: hold.wait(30))
    cancelled, kept = (worker.submit(alone, batch_key="same") for _ in range(2))
    hold.set()
    assert kept.future.result(30) == {"data": ["alone"]}
    with pytest.raises(ApiError) as raised:
        cancelled.future.result(30)
    assert raised.value.code == "cancelled"
    worker.stop()


def test_a_mask_of_another_shape_than_the_image_crops_without_a_pillow_error():
    """With padding_mask_crop, a tall mask on a wide image crops a sliver that fitted to 0 px wide."""
    source = masks.prepare_source(PIL.Image.new("RGB", (128, 16)), PIL.Image.new("L", (16, 4000), 255), 4)
    assert source.pixels.shape == (16, 128, 3)


FORMS = [["ink:0.8"], [["ink", 0.8]], [{"name": "ink", "scale": 0.8}], [("ink", 0.8)]]
"""The spellings of one LoRA at 0.8 (the last: Python's tuple, a JSON list over the wire)."""


def _http(loras):
    """The request an HTTP JSON body with these `loras` asks for (the server's schema, no server)."""
    return schema.to_request(schema.validate({"prompt": "a fox", "loras": loras}), ServeOptions())


def _form(loras_field: str):
    return schema.to_request(schema.from_form({"prompt": "a fox", "loras": loras_field}), ServeOptions())


def _line(loras, tmp_path):
    return lines.parse_line(1, json.dumps({"prompt": "a fox", "loras": loras}), tmp_path)


def test_every_front_end_takes_every_spelling_of_a_lora(tmp_path):
    want = (LoraUse("ink", 0.8),)
    for loras in FORMS:
        assert GenerationRequest(prompt="a fox", loras=loras).loras == want  # Python
        assert _line(loras, tmp_path).request.loras == want  # a klein batch line
        assert _http(loras).loras == want, loras  # an HTTP JSON body
        assert _form(json.dumps(loras)).loras == want, loras  # a form field, as JSON
        written = repr(loras)  # klein generate's key=value word: lora_apply="[('ink', 0.8)]"
        assert GenerationRequest(prompt="a fox", loras=kinds.read_loras("lora_apply", written)).loras == want


def test_a_form_field_takes_one_lora_as_text():
    assert _form("ink:0.8").loras == (LoraUse("ink", 0.8),)
    assert _form("ink").loras == (LoraUse("ink", 1.0),)


def refusal(send) -> ApiError:
    with pytest.raises(ApiError) as raised:
        send()
    assert raised.value.status == 400
    return raised.value


def test_a_scale_past_the_range_is_refused_in_every_front_end(tmp_path, capsys):
    """1e39 is finite in JSON and Python, and inf in float32: an image of NaNs without a word."""
    with pytest.raises(InputError, match=r"loras: the scale of 'ink' must be a number from -100 to 100"):
        GenerationRequest(prompt="a fox", loras=[("ink", 1e39)])
    error = refusal(lambda: _http([["ink", 1e39]]))
    assert "the scale of 'ink' must be a number from -100 to 100, got 1e+39" in error.message
    assert error.param == "loras"
    assert "from -100 to 100" in _line(["ink:-1e39"], tmp_path).message
    assert cli.main(["generate", "--prompt", "a fox", "--lora-apply", "ink:1e39"]) == 2
    assert "the scale must be a number from -100 to 100" in capsys.readouterr().err
    assert GenerationRequest(prompt="a fox", loras=[("ink", -100)]).loras == (LoraUse("ink", -100.0),)


def test_a_misspelt_key_of_a_lora_is_named_where_it_is():
    """Not a top-level field: the LoRA's own keys, and other tools' name of the scale."""
    with pytest.raises(InputError, match=r"unknown key 'weight' in loras\[1\]; did you mean 'scale'\?"):
        GenerationRequest(prompt="a fox", loras=["pen", {"name": "ink", "weight": 1}])
    error = refusal(lambda: _http([{"name": "ink", "weight": 1}]))
    assert error.message == "unknown field 'weight' in loras[0]; did you mean 'scale'?"
    assert error.param == "loras"
    assert "did you mean 'scale'?" in refusal(lambda: _http([{"name": "ink", "scael": 1}])).message


def test_an_unknown_lora_name_gets_the_nearest_in_each_front_ends_words():
    from klein.errors import CLI, HTTP, PYTHON, WordedError, worded
    from klein.lora.registry import check_known

    sets = GenerationRequest(prompt="a fox", loras=["inc:0.8"]).lora_sets
    with pytest.raises(WordedError) as raised:
        check_known(sets, ("ink", "pen"))
    said = {words: worded(raised.value, words) for words in (PYTHON, CLI, HTTP)}
    assert all("no LoRA named 'inc'" in text and "did you mean 'ink'?" in text for text in said.values())
    assert said[PYTHON].startswith("loras:") and "pipe.load_lora" in said[PYTHON]
    assert said[CLI].startswith("--lora-apply:") and "--lora-dir" in said[CLI]
    assert "GET /v1/loras" in said[HTTP] and not any("pipe." in said[w] for w in (CLI, HTTP))
    assert str(raised.value) == said[PYTHON]
    again = pickle.loads(pickle.dumps(raised.value))  # it crosses processes (replicas, Ray) whole
    assert worded(again, HTTP) == said[HTTP] and again.field == "loras"


def test_the_cli_names_its_flags_for_an_unknown_lora(klein_home, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KLEIN_HOME", str(klein_home))
    shapes = lf.linear_shapes(TransformerConfig.from_diffusers(demo.TRANSFORMER), "bfl")
    offered = tmp_path / "loras"
    offered.mkdir()
    lf.write_bfl(offered / "ink.safetensors", lf.random_lora(shapes, 4, 2))
    words = ["generate", "--prompt", "a fox", "--height", "64", "--width", "64", "--steps", "1"]
    out = str(tmp_path / "x.png")
    assert cli.main([*words, "--lora-dir", str(offered), "--lora-apply", "inc", "--out", out]) == 2
    said = capsys.readouterr().err
    assert "error: --lora-apply: no LoRA named 'inc' is offered; did you mean 'ink'? (offered: ink)" in said
    assert "--lora-dir" in said and "pipe.load_lora" not in said


def test_loras_over_loopback_in_every_spelling_are_read_and_worded_for_http(serve_url):
    """The shared server offers no LoRA: each spelling is read, then refused for its name, as a field."""
    for loras in (["ink:0.8"], [["ink", 0.8]], [{"name": "ink", "scale": 0.8}]):
        response = httpx.post(serve_url + "/v1/images/generations", json={**GOOD, "loras": loras}, timeout=60)
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == "loras", error
        assert error["message"].startswith("loras: no LoRA named 'ink' is offered (offered: none)")
        assert "GET /v1/loras" in error["message"] and "pipe.load_lora" not in error["message"]
    nested = {**GOOD, "loras": [{"name": "ink", "weight": 1}]}
    error = httpx.post(serve_url + "/v1/images/generations", json=nested, timeout=60).json()["error"]
    assert error["message"] == "unknown field 'weight' in loras[0]; did you mean 'scale'?"
