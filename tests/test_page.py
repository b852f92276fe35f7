"""The editing page in real headless Chromium, against a real `klein serve` (demo checkpoint) on loopback.

One edit loop as a person would do it: upload a reference, prompt, Generate, watch the steps, see the
image; a second prompt on the same reference shows the cache hit; the result becomes the reference of the
next edit; a download keeps klein's PNG metadata. Then what the server refuses is shown inline with the
prompt kept. Throughout: no console errors and no request that leaves the server's origin.
"""

import io
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from importlib import resources
from urllib.parse import urlsplit

import numpy as np
import PIL.Image
import pytest
from playwright.sync_api import expect, sync_playwright

MAX_REFERENCES = 3
MAX_UPLOAD_BYTES = 64 * 1024
SERVE_FLAGS = ["--max-steps", "2", "--max-references", MAX_REFERENCES, "--max-upload-bytes", MAX_UPLOAD_BYTES]
GENERATION_TIMEOUT_MS = 120_000  # the first one compiles the demo model on a loaded 2-core machine

# Every status line the page shows, recorded as it is written (steps pass faster than a poll could see).
RECORD_STATUS = """
window.statusLines = [];
document.addEventListener("DOMContentLoaded", () => {
  const status = document.getElementById("status");
  new MutationObserver((records) => {
    for (const record of records) for (const node of record.addedNodes) window.statusLines.push(node.textContent);
  }).observe(status, {childList: true});
});
"""


def png_bytes(width: int, height: int, noise: bool = False) -> bytes:
    rng = np.random.default_rng(width)
    if noise:  # incompressible: a PNG far over the upload limit
        pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    else:
        y, x = np.mgrid[0:height, 0:width]
        pixels = np.stack([x * 255 // width, y * 255 // height, np.full_like(x, 96)], -1).astype(np.uint8)
    buffer = io.BytesIO()
    PIL.Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def png_file(name: str, width: int, height: int, noise: bool = False) -> dict:
    return {"name": name, "mimeType": "image/png", "buffer": png_bytes(width, height, noise)}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until_healthy(url: str, process: subprocess.Popen, log_path, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"klein serve exited with {process.returncode}:\n{log_path.read_text()}")
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.25)
    raise AssertionError(f"klein serve was not healthy within {seconds} s:\n{log_path.read_text()}")


@pytest.fixture(scope="module")
def server(klein_home, tmp_path_factory):
    """The URL of a `klein serve` subprocess on the demo checkpoint, small limits, loopback only."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {**os.environ, "KLEIN_HOME": str(klein_home), "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-m", "klein.cli.main", "serve", "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [*command, *map(str, SERVE_FLAGS)], env=env, stdout=log, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, process, log_path)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        yield chromium
        chromium.close()


@pytest.fixture
def visit(server, browser):
    """Opens the page; yields (page, console errors, requested URLs) and checks every request's origin."""
    context = browser.new_context(viewport={"width": 1280, "height": 800}, accept_downloads=True)
    page = context.new_page()
    errors, requests = [], []
    page.on("console", lambda message: message.type == "error" and errors.append(message.text))
    page.on("pageerror", lambda error: errors.append(f"uncaught: {error}"))
    page.on("request", lambda request: requests.append(request.url))
    page.add_init_script(RECORD_STATUS)
    page.goto(f"{server}/")
    expect(page.locator("#model")).to_contain_text("demo")
    yield page, errors, requests
    context.close()
    foreign = [url for url in requests if not url.startswith("data:") and origin(url) != server]
    assert not foreign, f"requests left the server's origin: {foreign}"


def origin(url: str) -> str:
    parts = urlsplit(url.removeprefix("blob:"))
    return f"{parts.scheme}://{parts.netloc}"


def generate(page, prompt: str, results: int) -> None:
    page.fill("#prompt", prompt)
    page.click("#generate")
    expect(page.locator("#history li")).to_have_count(results, timeout=GENERATION_TIMEOUT_MS)
    expect(page.locator("#generate")).to_be_enabled()


def test_every_page_file_is_served_and_names_no_other_host():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from klein.serve import page

    client = TestClient(FastAPI(routes=page.router.routes))
    folder = resources.files("klein.serve") / "static"
    names = sorted(item.name for item in folder.iterdir())
    assert names == sorted(page.ASSETS)
    for name in names:
        response = client.get("/" if name == "index.html" else f"/static/{name}")
        assert response.status_code == 200 and response.headers["content-type"] == page.ASSETS[name]
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", response.text, re.IGNORECASE), name
    assert client.get("/static/..%2Fpage.py").status_code == 404
    assert client.get("/static/index.js").status_code == 404


def test_edit_loop_with_cache_hit_and_result_as_reference(visit, tmp_path):
    page, errors, requests = visit
    page.set_input_files("#ref-input", [png_file("portrait.png", 96, 96)])
    expect(page.locator("#refs li")).to_have_count(1)

    generate(page, "a fox in the snow", results=1)
    expect(page.locator("#current .result img")).to_have_count(1)
    assert page.eval_on_selector("#current .result img", "img => img.naturalWidth") == 96
    lines = page.evaluate("window.statusLines")
    assert "Step 1 of 2" in lines and any(line.startswith("Step 2 of 2") for line in lines), lines
    expect(page.locator("#current .cache")).to_contain_text("Encoded")
    assert page.locator("#current .timings .timing").count() >= 3  # stages and the total

    # Ctrl+Enter with a fixed seed and another prompt: the same reference comes from the cache.
    page.get_by_text("Fixed", exact=True).click()
    expect(page.locator("#seed-fixed")).to_be_checked()
    page.get_by_label("Seed value").fill("1234")
    page.fill("#prompt", "the same fox at night")
    page.focus("#prompt")
    page.keyboard.press("Control+Enter")
    expect(page.locator("#history li")).to_have_count(2, timeout=GENERATION_TIMEOUT_MS)
    expect(page.locator("#current .cache")).to_contain_text("Cache hit")
    expect(page.locator("#current .cache")).to_contain_text("saved")
    expect(page.locator("#current .facts")).to_contain_text("1234")

    with page.expect_download() as download:
        page.click("#current .download")
    saved = PIL.Image.open(download.value.path())
    assert saved.text["prompt"] == "the same fox at night" and saved.text["seed"] == "1234"

    # The editing loop: the result becomes the reference of the next edit, in place of the first one
    # (the same size, so the server reuses its compiled shapes).
    page.click("#current .use")
    expect(page.locator("#refs li")).to_have_count(2)
    page.get_by_role("button", name="Remove reference 1").click()
    expect(page.locator("#refs .ref-name")).to_have_text(["klein-1234.png"])
    generate(page, "make it snow harder", results=3)
    expect(page.locator("#current .facts .fact-refs img")).to_have_count(1)
    expect(page.locator("#current .cache")).to_contain_text("Encoded")
    # The unchanged list was uploaded once for the first two edits, then the result once.
    uploads = [request for request in requests if request.endswith("/v1/references")]
    assert len(uploads) == 2, requests
    page.screenshot(path=tmp_path / "page.png")
    assert not errors, errors


def test_refusals_are_inline_and_keep_what_was_entered(visit):
    page, errors, _ = visit
    page.fill("#prompt", "a lighthouse at dusk")
    page.set_input_files("#ref-input", [png_file("large.png", 256, 256, noise=True)])
    page.click("#generate")
    error = page.locator("#error")
    expect(error).to_be_visible()
    expect(error).to_contain_text("--max-upload-bytes")
    expect(page.locator("#prompt")).to_have_value("a lighthouse at dusk")
    expect(page.locator("#refs li")).to_have_count(1)
    expect(page.locator("#generate")).to_be_enabled()
    # The browser itself logs the refused response; nothing else may have gone wrong.
    assert len(errors) == 1 and "413" in errors[0], errors

    # More references than the server takes: refused on the page, which read the limit from /v1/config.
    files = [png_file(f"ref{i}.png", 64 + 16 * i, 64) for i in range(MAX_REFERENCES)]
    page.set_input_files("#ref-input", files)
    expect(page.locator("#refs li")).to_have_count(MAX_REFERENCES)
    expect(error).to_contain_text(f"at most {MAX_REFERENCES} references")
    expect(page.locator("#ref-input")).to_be_disabled()

    # Keyboard reordering: the second reference moves first and keeps the focus on its controls.
    page.focus("#refs li:nth-child(2) .up")
    page.keyboard.press("Enter")
    expect(page.locator("#refs li:nth-child(1) .ref-name")).to_have_text("ref0.png")
    expect(page.locator("#refs li:nth-child(1) .down")).to_be_focused()
    page.keyboard.press("Tab")
    page.keyboard.press("Enter")  # its remove button
    expect(page.locator("#refs li")).to_have_count(MAX_REFERENCES - 1)
    assert "ref0.png" not in page.locator("#refs .ref-name").all_inner_texts()
    assert len(errors) == 1, errors
