"""Previews over HTTP: `"preview": true` on POST /v1/jobs puts TAEF2's frames of the first image in the job's
events (at most one a second, a job keeping its latest alone); a server without TAEF2's weights refuses it
with a 400 saying what to download; elsewhere it is ignored with a warning. The page asks for them where
/v1/config says the server has them, and shows each frame until the result comes."""

import base64
import io
import json

import httpx
import numpy as np
import PIL.Image
import pytest
from playwright.sync_api import expect

from klein.io import taef2_checkpoint
from klein.io.demo import VERSION
from klein.io.taef2_checkpoint import load_taef2
from klein.pipeline.preview import Previewer
from klein.serve.previews import Frames
from tests.support.serve_process import job_events, running
from tests.support.taef2_reference import reference_decoder, save_reference


@pytest.fixture(scope="module")
def home(klein_home, tmp_path_factory):
    """A KLEIN_HOME with the session's demo checkpoint and random TAEF2 weights at their default place."""
    home = tmp_path_factory.mktemp("preview-home")
    (home / VERSION).symlink_to(klein_home / VERSION, target_is_directory=True)
    save_reference(reference_decoder(seed=2), home / taef2_checkpoint.DEFAULT_NAME)
    return home


@pytest.fixture(scope="module")
def url(home):
    with running(home) as url:
        yield url


def events_of(url: str, job: str) -> list[tuple[str, dict]]:
    return job_events(url, job, timeout=120)


def jpeg(url: str) -> PIL.Image.Image:
    assert url.startswith("data:image/jpeg;base64,")
    image = PIL.Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    assert image.format == "JPEG"
    return image


def test_a_jobs_events_carry_frames_of_its_first_image(url):
    body = {"prompt": "a kite", "size": "64x48", "seed": 1, "num_inference_steps": 3, "preview": True}
    created = httpx.post(url + "/v1/jobs", json=body)
    assert created.status_code == 202, created.text
    events = events_of(url, created.json()["id"])
    names = [name for name, _ in events]
    frames = [data for name, data in events if name == "preview"]
    assert names[-1] == "done" and frames and frames[0]["step"] == 1
    assert [f["step"] for f in frames] == sorted({f["step"] for f in frames}) and frames[-1]["step"] <= 3
    assert names.index("preview") < names.index("done") and frames[-1]["image"] is not None
    for frame in frames:
        if frame["image"] is not None:  # a frame superseded before the stream sent it has none
            image = jpeg(frame["image"])
            assert image.size == (64, 48) and np.asarray(image).std() > 0
    assert events[-1][1]["klein"]["warnings"] == []


def test_preview_outside_a_job_is_ignored_with_a_warning(url):
    # The job's size and batch: its programs serve (a schedule's length is data).
    body = {"prompt": "a kite", "size": "64x48", "num_inference_steps": 1, "preview": True}
    answer = httpx.post(url + "/v1/images/generations", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    assert any("preview is ignored" in note for note in answer.json()["klein"]["warnings"])


def test_a_server_without_taef2_refuses_previews_saying_what_to_download(serve_url, klein_home):
    body = {"prompt": "a kite", "size": "32x32", "num_inference_steps": 1, "preview": True}
    answer = httpx.post(serve_url + "/v1/jobs", json=body)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "preview" and error["code"] == "invalid_value"
    assert taef2_checkpoint.DOWNLOAD in error["message"]
    assert str(klein_home / taef2_checkpoint.DEFAULT_NAME) in error["message"]


# Every frame the page shows, recorded as it is set (a job's few frames pass faster than a poll could see).
RECORD_FRAMES = """
window.previewFrames = [];
document.addEventListener("DOMContentLoaded", () => {
  const frame = document.getElementById("preview");
  new MutationObserver(() => frame.src && window.previewFrames.push(frame.src))
    .observe(frame, {attributes: true, attributeFilter: ["src"]});
});
"""


def test_the_page_asks_for_previews_and_shows_the_image_as_it_forms(url, browser):
    assert httpx.get(url + "/v1/config").json()["previews"] is True
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page, errors = context.new_page(), []
    page.on("console", lambda message: message.type == "error" and errors.append(message.text))
    page.add_init_script(RECORD_FRAMES)
    try:
        page.goto(f"{url}/")
        expect(page.locator("#generate")).to_be_enabled()
        page.select_option("#size", "custom")
        page.fill("#width", "64")
        page.fill("#height", "48")
        page.fill("#steps", "3")
        page.fill("#prompt", "a kite")
        with page.expect_request(lambda r: r.url.endswith("/v1/jobs") and r.method == "POST") as sent:
            page.click("#generate")
        expect(page.locator("#history li")).to_have_count(1, timeout=120_000)
        assert json.loads(sent.value.post_data)["preview"] is True
        frames = page.evaluate("window.previewFrames")
        assert frames and all(frame.startswith("data:image/jpeg;base64,") for frame in frames)
        expect(page.locator("#preview")).to_be_hidden()  # the result replaces it
        assert not errors, errors
    finally:
        context.close()


def test_frames_come_at_most_once_a_second_and_a_job_keeps_its_latest(home):
    previewer = Previewer(load_taef2(home / taef2_checkpoint.DEFAULT_NAME))
    events, times = [], iter([10.0, 10.5, 11.2, 11.9, 12.3])
    frames = Frames(previewer, events, clock=lambda: next(times))
    latents = np.random.default_rng(0).standard_normal((2, 6, 128)).astype(np.float32)
    for step in range(5):
        frames(step, 1000.0, latents, (2, 3))
    assert [(name, data["step"]) for name, data in events] == [("preview", 1), ("preview", 3), ("preview", 5)]
    assert [data["image"] is None for _, data in events] == [True, True, False]
    assert jpeg(events[-1][1]["image"]).size == (48, 32)
