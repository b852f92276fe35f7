"""The editing page in real headless Chromium, against a real `klein serve` (demo checkpoint) on loopback.

One edit loop as a person would do it: upload a reference, prompt, Generate, watch the upload and the
steps, see the image; a second prompt on the same reference shows the cache hit; the result becomes the
reference of the next edit; a download keeps klein's PNG metadata. Then: what the page refuses when a file
is picked and what the server refuses, shown inline with the prompt kept; limits only from /v1/config;
results and references kept across a reload, their object URLs revoked when they go; one retry policy for
every request; the notice that a fresh server's first request compiles, and what a server compiling ahead
shows while it warms. Throughout: no request that leaves the server's origin and, where nothing is refused on
purpose, no console errors.
"""

import collections
import contextlib
import dataclasses
import io
import json
import re
import time
from importlib import resources
from urllib.parse import urlsplit

import httpx
import numpy as np
import PIL.Image
import pytest
from playwright.sync_api import expect

from tests.support.serve_process import metrics, running

MAX_REFERENCES = 3
MAX_UPLOAD_BYTES = 64 * 1024
MAX_PIXELS = 1_000_000  # 1024 x 1024 is over it, 1280 x 720 under
SERVE_FLAGS = ["--max-steps", "2", "--max-references", MAX_REFERENCES, "--max-upload-bytes", MAX_UPLOAD_BYTES]
SERVE_FLAGS += ["--max-pixels", MAX_PIXELS]
GENERATION_TIMEOUT_MS = 120_000  # the first one compiles the demo model on a loaded 2-core machine

# Every status line the page shows and every value of its progress bar, recorded as they are written
# (steps pass faster than a poll could see).
RECORD_PROGRESS = """
window.statusLines = [];
window.barValues = [];
document.addEventListener("DOMContentLoaded", () => {
  const status = document.getElementById("status");
  new MutationObserver((records) => {
    for (const record of records) for (const node of record.addedNodes) window.statusLines.push(node.textContent);
  }).observe(status, {childList: true});
  const bar = document.getElementById("progress");
  new MutationObserver(() => {
    window.barValues.push([status.textContent, bar.hasAttribute("value") ? bar.value : null]);
  }).observe(bar, {attributes: true, attributeFilter: ["value"]});
});
"""

# The object URLs the page holds: made and not yet revoked.
RECORD_OBJECT_URLS = """
window.liveURLs = new Set();
const create = URL.createObjectURL, revoke = URL.revokeObjectURL;
URL.createObjectURL = (blob) => { const url = create(blob); window.liveURLs.add(url); return url; };
URL.revokeObjectURL = (url) => { window.liveURLs.delete(url); revoke(url); };
"""


def png_bytes(width: int, height: int, noise: bool = False) -> bytes:
    rng = np.random.default_rng(width)
    if noise:  # incompressible: width x height x 3 bytes and a little more
        pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    else:
        y, x = np.mgrid[0:height, 0:width]
        pixels = np.stack([x * 255 // width, y * 255 // height, np.full_like(x, 96)], -1).astype(np.uint8)
    buffer = io.BytesIO()
    PIL.Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def png_file(name: str, width: int, height: int, noise: bool = False) -> dict:
    return {"name": name, "mimeType": "image/png", "buffer": png_bytes(width, height, noise)}


@pytest.fixture(scope="module")
def server(serve_with):
    """The URL of a `klein serve` subprocess on the demo checkpoint, small limits, loopback only: one per
    worker, which test_page_mask.py and test_page_origin.py share where they run on the same one."""
    return serve_with(*SERVE_FLAGS)


@dataclasses.dataclass
class Tab:
    page: object
    errors: list  # console errors and uncaught exceptions
    requests: list  # every URL the page asked for
    url: str  # the server's

    def open(self) -> None:
        """Loads the page and waits until it has read /v1/config."""
        self.page.goto(f"{self.url}/")
        expect(self.page.locator("#model")).to_contain_text("demo")
        expect(self.page.locator("#generate")).to_be_enabled()


@contextlib.contextmanager
def new_tab(browser, url: str):
    """A page in a fresh browser context (its own storage), not yet opened; at the end, checks that
    every request went to the server's origin."""
    context = browser.new_context(viewport={"width": 1280, "height": 800}, accept_downloads=True)
    page = context.new_page()
    tab = Tab(page, [], [], url)
    page.on("console", lambda message: message.type == "error" and tab.errors.append(message.text))
    page.on("pageerror", lambda error: tab.errors.append(f"uncaught: {error}"))
    page.on("request", lambda request: tab.requests.append(request.url))
    page.add_init_script(RECORD_PROGRESS)
    page.add_init_script(RECORD_OBJECT_URLS)
    try:
        yield tab
    finally:
        context.close()
    foreign = [each for each in tab.requests if not each.startswith("data:") and origin(each) != url]
    assert not foreign, f"requests left the server's origin: {foreign}"


@pytest.fixture
def tab(server, browser):
    with new_tab(browser, server) as opened:
        yield opened


def origin(url: str) -> str:
    parts = urlsplit(url.removeprefix("blob:"))
    return f"{parts.scheme}://{parts.netloc}"


def generate(page, prompt: str, results: int) -> None:
    page.fill("#prompt", prompt)
    page.click("#generate")
    expect(page.locator("#history li")).to_have_count(results, timeout=GENERATION_TIMEOUT_MS)
    expect(page.locator("#generate")).to_be_enabled()


def widths(page, selector: str) -> list[int]:
    """The natural widths of the images `selector` finds, once decoded (0: one that cannot be)."""
    decoded = "imgs => Promise.all(imgs.map((img) => img.decode().then(() => img.naturalWidth, () => 0)))"
    return page.eval_on_selector_all(selector, decoded)


def seconds(text: str) -> float:
    """The seconds in a text the page wrote with formatSeconds ("0.42 s", "12.3 s", "7 ms")."""
    number, unit = re.search(r"([\d.]+) (s|ms)\b", text).groups()
    return float(number) / (1000 if unit == "ms" else 1)


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


def test_a_fresh_server_says_once_that_its_first_request_compiles(server, klein_home, browser):
    """On the module's server while it has run no job (this test comes before the others that use it);
    otherwise on a server of its own."""
    with contextlib.ExitStack() as stack:
        url = server if ran_no_job(server) else stack.enter_context(running(klein_home, "--max-steps", "2"))
        tab = stack.enter_context(new_tab(browser, url))
        page = tab.page
        notice = page.locator("#notice")
        held = []
        # The job waits here, as long as a compilation would take.
        page.route("**/v1/jobs", lambda route: held.append(route))
        tab.open()
        page.select_option("#size", "256x256")  # not the model's 1024 x 1024: compiled and run at less cost
        page.fill("#prompt", "the first one")
        page.click("#generate")
        expect(notice).to_be_visible(timeout=10_000)
        expect(notice).to_contain_text("compiles")
        held.pop().continue_()
        expect(page.locator("#history li")).to_have_count(1, timeout=GENERATION_TIMEOUT_MS)
        expect(notice).to_be_hidden()
        # While the server compiles, the status says so rather than "Queued: next".
        lines = page.evaluate("window.statusLines")
        assert "Compiling (first run only): denoising…" in lines, lines
        assert "Queued: next" not in lines and "Starting…" in lines, lines

        # Said once: a later slow request on this server, here or after a reload, goes without it.
        assert httpx.get(f"{url}/v1/config").json()["jobs_done"] == 1
        page.reload()
        expect(page.locator("#generate")).to_be_enabled()
        page.select_option("#size", "256x256")
        page.fill("#prompt", "the second one")
        page.click("#generate")
        page.wait_for_timeout(4000)
        expect(notice).to_be_hidden()
        held.pop().continue_()
        expect(page.locator("#status")).to_contain_text("Done in", timeout=GENERATION_TIMEOUT_MS)
        assert not tab.errors, tab.errors


def ran_no_job(url: str) -> bool:
    return not any(value for name, value in metrics(url).items() if name.startswith("klein_jobs_total"))


def test_edit_loop_with_cache_hit_and_result_as_reference(tab, tmp_path):
    page, errors, requests = tab.page, tab.errors, tab.requests
    tab.open()
    page.set_input_files("#ref-input", [png_file("portrait.png", 96, 96)])
    expect(page.locator("#refs li")).to_have_count(1)

    generate(page, "a fox in the snow", results=1)
    expect(page.locator("#current .result img")).to_have_count(1)
    assert page.eval_on_selector("#current .result img", "img => img.naturalWidth") == 96
    lines = page.evaluate("window.statusLines")
    assert "Step 1 of 2" in lines and any(line.startswith("Step 2 of 2") for line in lines), lines
    # The status names the server's stage as it starts; a job that is next in line is not "Queued".
    stages = [lines.index(line) for line in ("Encoding prompt…", "Denoising…", "Step 1 of 2", "Decoding…")]
    assert stages == sorted(stages), lines
    assert not [line for line in lines if line.startswith("Queued:")], lines
    expect(page.locator("#current .cache")).to_contain_text("Encoded")
    assert page.locator("#current .timings .timing").count() >= 3  # stages and the total

    # "Done in" counts from the click: the upload and encoding, then the server's stages, and the wait.
    done = seconds(page.locator("#status").inner_text())
    upload = seconds(page.locator("#current .cache").inner_text())
    rows = page.locator("#current .timing:not(.total)").all_inner_texts()
    server_stages = sum(seconds(row) for row in rows if not row.startswith("upload"))
    assert done == seconds(page.locator("#current .timing.total .seconds").inner_text())
    assert done >= upload + server_stages - 0.03, (done, upload, rows)

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


def test_the_bar_follows_the_upload_then_the_encoding(tab):
    page = tab.page
    tab.open()
    # A throttled upload (about a second for this file) reports its progress on the way.
    page.set_input_files("#ref-input", [png_file("slow.png", 128, 128, noise=True)])
    expect(page.locator("#refs li")).to_have_count(1)
    devtools = page.context.new_cdp_session(page)
    devtools.send("Network.enable")
    conditions = {"offline": False, "latency": 0, "downloadThroughput": -1, "uploadThroughput": 40 * 1024}
    devtools.send("Network.emulateNetworkConditions", conditions)
    generate(page, "a slow upload", results=1)
    lines = page.evaluate("window.statusLines")
    shares = [int(share) for share in re.findall(r"^Uploading 1 reference: (\d+)%$", "\n".join(lines), re.M)]
    assert shares and shares[-1] == 100 and any(0 < share < 100 for share in shares), lines
    encoding = lines.index("Encoding 1 reference…")
    assert lines.index(f"Uploading 1 reference: {shares[0]}%") < encoding < lines.index("Queued"), lines
    bar = [value for text, value in page.evaluate("window.barValues") if text.startswith("Uploading")]
    assert any(0 < value < 1 for value in bar), bar
    assert not tab.errors, tab.errors


def test_refusals_are_inline_and_keep_what_was_entered(tab):
    page, errors = tab.page, tab.errors
    tab.open()
    page.fill("#prompt", "a lighthouse at dusk")
    error = page.locator("#error")

    # Refused when picked, not at Generate: a file that is not an image, one that only says it is, and
    # one larger than the server takes in an upload (the limit read from /v1/config).
    fake = {"name": "notes.png", "mimeType": "image/png", "buffer": b"not a png"}
    page.set_input_files("#ref-input", [fake])
    expect(error).to_contain_text("notes.png is not an image")
    page.set_input_files("#ref-input", [png_file("large.png", 256, 256, noise=True)])
    expect(error).to_contain_text("--max-upload-bytes")
    drop_text_file = """() => {
      const files = new DataTransfer();
      files.items.add(new File(["a shopping list"], "list.txt", {type: "text/plain"}));
      document.getElementById("drop").dispatchEvent(new DragEvent("drop", {dataTransfer: files, bubbles: true}));
    }"""
    page.evaluate(drop_text_file)
    expect(error).to_contain_text("list.txt is not an image")
    expect(page.locator("#refs li")).to_have_count(0)

    # What only the server can refuse: two images, each within the upload limit, over it together.
    halves = [png_file(f"half{i}.png", 128 + 16 * i, 128, noise=True) for i in range(2)]
    page.set_input_files("#ref-input", halves)
    expect(page.locator("#refs li")).to_have_count(2)
    page.click("#generate")
    expect(error).to_be_visible()
    expect(error).to_contain_text("--max-upload-bytes")
    expect(page.locator("#prompt")).to_have_value("a lighthouse at dusk")
    expect(page.locator("#refs li")).to_have_count(2)
    expect(page.locator("#generate")).to_be_enabled()
    # The browser itself logs the refused response; nothing else may have gone wrong.
    assert len(errors) == 1 and "413" in errors[0], errors

    # More references than the server takes: refused on the page, which read the limit from /v1/config.
    files = [png_file(f"ref{i}.png", 64 + 16 * i, 64) for i in range(MAX_REFERENCES)]
    page.set_input_files("#ref-input", files)
    expect(page.locator("#refs li")).to_have_count(MAX_REFERENCES)
    expect(error).to_contain_text(f"at most {MAX_REFERENCES} references")
    expect(page.locator("#ref-input")).to_be_disabled()

    # Keyboard reordering: the third reference moves up and keeps the focus on its controls.
    page.focus("#refs li:nth-child(3) .up")
    page.keyboard.press("Enter")
    expect(page.locator("#refs li:nth-child(2) .ref-name")).to_have_text("ref0.png")
    expect(page.locator("#refs li:nth-child(2) .up")).to_be_focused()
    page.keyboard.press("Tab")
    page.keyboard.press("Tab")
    page.keyboard.press("Enter")  # its remove button
    expect(page.locator("#refs li")).to_have_count(MAX_REFERENCES - 1)
    assert "ref0.png" not in page.locator("#refs .ref-name").all_inner_texts()
    assert len(errors) == 1, errors


def test_limits_and_defaults_come_from_the_server(tab):
    page = tab.page
    config = httpx.get(f"{tab.url}/v1/config").json()
    held = []
    page.route("**/v1/config", lambda route: held.append(route))
    page.goto(f"{tab.url}/")
    # Until the server has said, the page assumes no limit and cannot generate.
    expect(page.locator("#model")).to_have_text("connecting…")
    expect(page.locator("#generate")).to_be_disabled()
    expect(page.locator("#ref-count")).to_have_text("")
    expect(page.locator("#ref-input")).to_be_disabled()
    for field in ("#steps", "#count", "#width"):
        assert page.eval_on_selector(field, "input => input.max + input.step") == "", field
    held.pop().continue_()
    expect(page.locator("#generate")).to_be_enabled()

    expect(page.locator("#ref-count")).to_have_text(f"0 of {MAX_REFERENCES}")
    expect(page.locator("#steps")).to_have_attribute("max", "2")
    expect(page.locator("#steps")).to_have_value(str(min(config["default_steps"], 2)))
    expect(page.locator("#count")).to_have_attribute("max", str(config["max_images"]))
    expect(page.locator("#width")).to_have_attribute("step", str(config["size_multiple"]))
    expect(page.locator("#size option", has_text="1024 × 1024")).to_be_disabled()
    expect(page.locator("#size option", has_text="1280 × 720")).to_be_enabled()
    expect(page.locator("#loras-panel")).to_be_hidden()  # this server offers no LoRAs: no picker

    # A custom size is checked against the same limits before anything is sent.
    page.fill("#prompt", "a wide field")
    page.select_option("#size", "custom")
    page.fill("#width", "1008")
    page.fill("#height", "1008")
    page.click("#generate")
    expect(page.locator("#error")).to_contain_text(f"more than the {MAX_PIXELS} px")
    page.fill("#width", "8")
    page.click("#generate")
    expect(page.locator("#error")).to_contain_text(f"must be a whole number from {config['min_side']}")
    expect(page.locator("#width")).to_be_focused()
    assert not any(request.endswith("/v1/jobs") for request in tab.requests)
    assert not tab.errors, tab.errors


def test_results_and_references_are_kept_across_a_reload(tab):
    page = tab.page
    tab.open()
    page.set_input_files("#ref-input", [png_file("kept.png", 80, 64)])
    generate(page, "a kept fox", results=1)
    page.select_option("#size", "256x256")
    generate(page, "a kept owl", results=2)

    page.reload()
    expect(page.locator("#model")).to_contain_text("demo")
    expect(page.locator("#refs .ref-name")).to_have_text(["kept.png"])
    expect(page.locator("#refs .ref-size")).to_have_text(["80 × 64"])
    expect(page.locator("#size option").first).to_have_text("From first reference (80 × 64)")
    expect(page.locator("#history .history-prompt")).to_have_text(["a kept owl", "a kept fox"])
    expect(page.locator("#current .prompt-shown")).to_have_text("a kept owl")
    assert widths(page, "#current .result img") == [256]
    assert widths(page, "#current .fact-refs img") == [80]

    # The restored results go on as before: shown, reused, removed (and then gone after a reload too);
    # numbering continues after them.
    page.get_by_role("button", name="Show result 1: a kept fox").click()
    expect(page.locator("#current .prompt-shown")).to_have_text("a kept fox")
    page.get_by_role("button", name="Remove result 2").click()
    expect(page.locator("#history li")).to_have_count(1)
    page.click("#current .use")
    expect(page.locator("#refs li")).to_have_count(2)
    generate(page, "a third", results=2)
    expect(page.locator("#history .muted").first).to_contain_text("#3")
    page.reload()
    expect(page.locator("#history .history-prompt")).to_have_text(["a third", "a kept fox"])
    expect(page.locator("#refs li")).to_have_count(2)

    # The byte budget drops the oldest results first, never the newest.
    drops = page.evaluate("""async () => {
      const {oldestOver} = await import("./static/storage.js");
      const entry = (number, bytes) => ({number, images: [{blob: new Blob([new Uint8Array(bytes)])}], refs: []});
      const entries = [entry(1, 400), entry(2, 300), entry(3, 200), entry(4, 500)];
      return [oldestOver(entries, 1400), oldestOver(entries, 1000), oldestOver(entries, 100)];
    }""")
    assert drops == [[], [1], [1, 2, 3]]
    assert not tab.errors, tab.errors


def test_object_urls_are_revoked_when_their_image_goes(tab):
    page = tab.page
    tab.open()
    live = "() => window.liveURLs.size"
    page.set_input_files("#ref-input", [png_file("first.png", 64, 64), png_file("second.png", 80, 64)])
    expect(page.locator("#refs li")).to_have_count(2)
    generate(page, "two references", results=1)

    # Each image has its own URL: a reference removed from the list still shows with its result.
    page.get_by_role("button", name="Remove reference 1").click()
    page.get_by_role("button", name="Show result 1: two references").click()
    assert widths(page, "#current .fact-refs img") == [64, 80]

    # Gone from the page, gone from memory: removed references and results leave no URL behind.
    page.click("#current .use")
    page.get_by_role("button", name="Remove result 1").click()
    expect(page.locator("#history li")).to_have_count(0)
    assert page.evaluate(live) == 2  # the two references left
    for _ in range(2):
        page.get_by_role("button", name="Remove reference 1").click()
    expect(page.locator("#refs li")).to_have_count(0)
    assert page.evaluate(live) == 0
    assert not tab.errors, tab.errors


def test_one_retry_policy_for_every_request(tab):
    """No answer (the config, the event stream), a full queue (the job) and an unavailable server (the
    upload), each once: the page waits as told and asks again; a wait longer than it would sit through
    is shown instead."""
    page = tab.page
    calls = collections.Counter()

    def once(kind, status=None, retry_after="1"):
        def handle(route):
            calls[kind] += 1
            if calls[kind] > 1:
                return route.fallback()
            if status is None:
                return route.abort("connectionreset")
            error = {"error": {"message": f"{kind} refused on purpose", "code": "test"}}
            route.fulfill(status=status, headers={"Retry-After": retry_after}, json=error)

        return handle

    page.route("**/v1/config", once("config"))
    page.route("**/v1/references", once("references", 503))
    page.route("**/v1/jobs", once("jobs", 429))
    page.route("**/events", once("events"))
    tab.open()
    page.set_input_files("#ref-input", [png_file("retried.png", 64, 64)])
    generate(page, "asked twice", results=1)
    assert calls == {"config": 2, "references": 2, "jobs": 2, "events": 2}, calls
    lines = page.evaluate("window.statusLines")
    for line in (
        "No answer from the server: trying again in 1 s (1 of 3)",
        "The server is unavailable: trying again in 1 s (1 of 3)",
        "The server is busy: trying again in 1 s (1 of 3)",
    ):
        assert line in lines, lines

    page.unroute("**/v1/jobs")
    page.route("**/v1/jobs", once("long wait", 429, retry_after="120"))
    page.click("#generate")
    expect(page.locator("#error")).to_contain_text("Try again in 120 s")
    assert calls["long wait"] == 1


# Whether the compile notice was ever shown, however briefly.
RECORD_NOTICE = """
window.noticeShown = false;
document.addEventListener("DOMContentLoaded", () => {
  const notice = document.getElementById("notice");
  new MutationObserver(() => { if (!notice.hidden) window.noticeShown = true; })
    .observe(notice, {attributes: true, attributeFilter: ["hidden"]});
});
"""


def test_an_edit_asked_while_the_server_warms_waits_for_it_and_says_so_apart(klein_home, browser, tmp_path):
    """Generate pressed while the server compiles ahead: the page says it waits for the warm-up (not the
    notice for servers that compile on their first request), sends the edit once the warm-up is over, and
    tells the wait apart from the edit's own time; the size warmed compiles nothing."""
    # One reference at most: the warm-up compiles the edits of none and one (and a repaint), not of 0 to 4.
    flags = ("--max-steps", "2", "--warm-size", "128x128", "--max-references", "1")
    with running(klein_home, *flags, warm=True) as url, new_tab(browser, url) as tab:
        assert httpx.get(f"{url}/healthz").json()["status"] == "warming"
        page, status = tab.page, tab.page.locator("#status")
        page.add_init_script(RECORD_NOTICE)
        # Until released, the page hears that the server still warms, however fast it is here: the click
        # below lands in the warm-up, and the wait lasts at least as long as the real one.
        holding = [True]

        def config(route):
            answer = route.fetch()
            route.fulfill(
                response=answer, json={**answer.json(), "warming": answer.json()["warming"] or holding[0]}
            )

        page.route("**/v1/config", config)
        page.goto(f"{url}/")
        expect(status).to_contain_text("Warming up")
        page.set_input_files("#ref-input", [png_file("warm.png", 128, 128)])
        expect(page.locator("#refs li")).to_have_count(1)
        page.fill("#prompt", "asked while warming")
        page.click("#generate")
        expect(status).to_have_text(
            re.compile(r"^Waiting for the server to warm up .*: [3-9] s$"), timeout=30_000
        )
        page.screenshot(path=tmp_path / "waiting.png", full_page=True)
        deadline = time.monotonic() + 120
        while httpx.get(f"{url}/healthz").json()["status"] == "warming" and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not [each for each in tab.requests if re.search(r"/v1/(references|jobs)$", each)], tab.requests
        holding[0] = False
        expect(page.locator("#history li")).to_have_count(1, timeout=GENERATION_TIMEOUT_MS)

        lines = page.evaluate("window.statusLines")
        assert not page.evaluate("window.noticeShown"), lines
        # The size it warmed: the first edit found every program compiled.
        assert not [line for line in lines if line.startswith("Compiling")], lines
        # The wait, then the edit's own time: the total of its stages, not the two together.
        done = status.inner_text()
        waited, took = re.fullmatch(
            r"Waited (.+) for the server to warm up; generated in (.+)", done
        ).groups()
        assert seconds(waited) >= 3, done
        assert seconds(took) == seconds(page.locator("#current .timing.total .seconds").inner_text())
        expect(page.locator("#current .waited")).to_contain_text(f"Waited {waited} for the server")
        page.screenshot(path=tmp_path / "waited.png", full_page=True)
        assert not tab.errors, tab.errors


def test_custom_sizes_show_four_digits_and_the_drop_zone_reads_at_the_limit(tab, tmp_path):
    page = tab.page
    tab.open()
    page.select_option("#size", "custom")
    for width, height in (("1280", "1024"), ("4096", "4096")):
        page.fill("#width", width)
        page.fill("#height", height)
        for field in ("#width", "#height"):  # the whole value shows: nothing scrolled out of the field
            shown = page.eval_on_selector(field, "e => [e.value, e.scrollWidth, e.clientWidth]")
            assert shown[1] <= shown[2], (field, shown)
    page.set_input_files(
        "#ref-input", [png_file(f"r{k}.png", 64 + 16 * k, 64) for k in range(MAX_REFERENCES)]
    )
    expect(page.locator("#refs li")).to_have_count(MAX_REFERENCES)
    expect(page.locator("#drop")).to_have_text(
        f"All {MAX_REFERENCES} references added Remove one to add another"
    )
    page.screenshot(path=tmp_path / "limit.png")
    page.get_by_role("button", name="Remove reference 1").click()
    expect(page.locator("#drop")).to_have_text("Add reference images or drop / paste them here")
    assert not tab.errors, tab.errors


def test_the_servers_warnings_are_shown_with_the_result(tab):
    """What the server changed of the request (here a custom size rounded down) is said with the result."""
    page = tab.page
    page.goto(f"{tab.url}/")
    expect(page.locator("#generate")).to_be_enabled()
    page.select_option("#size", "custom")
    page.fill("#width", "72")
    page.fill("#height", "64")
    generate(page, "a rounded fox", 1)
    expect(page.locator(".details .warning")).to_have_text(
        ["height/width rounded down to multiples of 16: 64x64 px (WxH)"]
    )
    assert not tab.errors, tab.errors


def test_the_step_cache_is_sent_as_the_bodys_cache_and_its_passes_shown(tab):
    page = tab.page
    tab.open()
    expect(page.locator("#cache-threshold")).to_be_disabled()
    page.check("#cache")
    page.fill("#cache-threshold", "-1")
    page.fill("#prompt", "a cached fox")
    page.click("#generate")
    expect(page.locator("#error")).to_contain_text("threshold must be a number from 0")
    page.fill("#cache-threshold", "5")
    page.select_option("#size", "256x256")  # not the model's 1024 x 1024: compiled and run at less cost
    with page.expect_request(lambda r: r.url.endswith("/v1/jobs") and r.method == "POST") as sent:
        generate(page, "a cached fox", 1)
    assert json.loads(sent.value.post_data)["cache"] == {"threshold": 5}
    # The recipe's 8 warm-up steps cover this server's 2: every pass computes.
    expect(page.locator(".details .facts")).to_contain_text(
        "double blocks 2 of 2 passes, single blocks 2 of 2"
    )
    assert not tab.errors, tab.errors
