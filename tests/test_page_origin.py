"""The page of a keyless `klein serve` in headless Chromium, by the names it is reached by and from sites it
must refuse: an edit from http://127.0.0.1:PORT and from http://localhost:PORT; a page whose name rebinds
to 127.0.0.1 (DNS rebinding, simulated with Chromium's host resolver rules) gets 403; a page of another
site that posts a multipart edit to the server (a simple request: no preflight) gets 403, and no job runs.
"""

import contextlib
import http.server
import threading
from urllib.parse import urlsplit

import pytest
from playwright.sync_api import expect

from tests.support.serve_process import free_port, metrics
from tests.test_page import SERVE_FLAGS, generate, new_tab, png_file

EVIL = "evil.example"
# What a hostile page does: a form post with an image file, which browsers send cross-site unasked.
POST_FROM_EVIL = """async (target) => {
  const form = new FormData();
  form.append("prompt", "drawn by another site");
  form.append("image", new Blob([new Uint8Array([137, 80, 78, 71])], {type: "image/png"}), "a.png");
  await fetch(target + "/v1/images/edits", {method: "POST", body: form, mode: "no-cors"});
}"""


@pytest.fixture(scope="module")
def server(serve_with):
    """test_page.py's server (its limits are beyond what these tests send), started once per worker."""
    return serve_with(*SERVE_FLAGS)


@pytest.fixture(scope="module")
def rebinding(browser):
    """Chromium whose resolver sends evil.example to 127.0.0.1, as a rebound DNS name would."""
    other = browser.browser_type.launch(
        executable_path="/usr/bin/chromium",
        args=["--no-sandbox", f"--host-resolver-rules=MAP {EVIL} 127.0.0.1"],
    )
    yield other
    other.close()


@contextlib.contextmanager
def evil_site():
    """http://evil.example:PORT/: a blank page of another site, served on loopback."""

    class Blank(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(b"<!doctype html><title>another site</title>")

        def log_message(self, *args):
            pass

    site = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Blank)
    thread = threading.Thread(target=site.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{EVIL}:{site.server_address[1]}"
    finally:
        site.shutdown()


@pytest.mark.parametrize("name", ["127.0.0.1", "localhost"])
def test_the_page_edits_from_either_loopback_name(server, browser, name):
    url = f"http://{name}:{urlsplit(server).port}"
    with new_tab(browser, url) as tab:  # and no request leaves that origin
        tab.open()
        tab.page.set_input_files("#ref-input", [png_file("portrait.png", 64, 64)])
        expect(tab.page.locator("#refs li")).to_have_count(1)
        generate(tab.page, f"a fox seen from {name}", results=1)
        expect(tab.page.locator("#current .result img")).to_have_count(1)
        assert not tab.errors, tab.errors


def test_a_rebound_name_gets_403(server, rebinding):
    page = rebinding.new_page()
    answer = page.goto(f"http://{EVIL}:{urlsplit(server).port}/")
    assert answer.status == 403 and "forbidden_host" in page.content()
    page.close()


def test_another_sites_post_gets_403_and_runs_nothing(server, rebinding):
    before = metrics(server)
    with evil_site() as site:
        page = rebinding.new_page()
        page.goto(site + "/")
        with page.expect_response(lambda response: response.url.endswith("/v1/images/edits")) as posted:
            page.evaluate(POST_FROM_EVIL, server)
        assert posted.value.status == 403
        page.close()
    after = metrics(server)
    forbidden = 'klein_requests_total{status="403"}'
    assert after.get(forbidden, 0) - before.get(forbidden, 0) == 1
    jobs = [name for name in after if name.startswith("klein_jobs_total")]
    assert all(after[name] == before.get(name, 0) for name in jobs)
