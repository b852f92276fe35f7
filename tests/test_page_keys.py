"""The page of a keyed `klein serve` (--api-key) in headless Chromium: it opens asking for the key, with no
refusal shown before the person has done anything; a wrong key is said to be wrong (not "a key is needed"
again); the right one is sent on every API call of an edit and kept for the tab across a reload.
"""

import pytest
from playwright.sync_api import expect

from tests.support.serve_process import running
from tests.test_page import generate, new_tab

KEY = "page-test-key"


@pytest.fixture(scope="module")
def server(klein_home):
    with running(klein_home, "--max-steps", "2", "--api-key", KEY) as url:
        yield url


def test_the_keyed_page_asks_for_the_key_then_says_when_it_is_wrong(server, browser, tmp_path):
    with new_tab(browser, server) as tab:
        page, error, field = tab.page, tab.page.locator("#error"), tab.page.locator("#api-key")
        sent = []  # (path, the Authorization header) of each request
        page.on("request", lambda request: sent.append((request.url, request.headers.get("authorization"))))
        page.goto(f"{server}/")
        # Asked, not refused: the key field with the focus, and no error before anything was tried.
        expect(page.locator("#model")).to_have_text("API key needed")
        expect(page.locator("#auth")).to_be_visible()
        expect(field).to_be_focused()
        expect(error).to_be_hidden()
        expect(page.locator("#generate")).to_be_disabled()
        page.screenshot(path=tmp_path / "asked.png")

        # A wrong key reads as wrong, with the field kept to correct it.
        field.fill("not-the-key")
        field.press("Enter")
        expect(error).to_have_text("The server did not accept the API key sent: check it and enter it again.")
        expect(page.locator("#model")).to_have_text("API key refused")
        expect(page.locator("#auth")).to_be_visible()
        expect(field).to_have_attribute("aria-invalid", "true")
        expect(field).to_be_focused()
        page.screenshot(path=tmp_path / "wrong.png")

        field.fill(KEY)
        right = len(sent)
        page.get_by_role("button", name="Use key").click()
        expect(page.locator("#model")).to_contain_text("demo")
        expect(error).to_be_hidden()
        expect(page.locator("#auth")).to_be_hidden()
        page.select_option("#size", "256x256")
        generate(page, "a fox behind a locked door", results=1)
        # The config, the LoRAs, the job and its events: each with the key.
        api_calls = [(url.split("/v1/")[1], key) for url, key in sent[right:] if "/v1/" in url]
        assert len(api_calls) >= 4 and {key for _, key in api_calls} == {f"Bearer {KEY}"}, api_calls

        # Kept for this tab: a reload asks for nothing.
        page.reload()
        expect(page.locator("#model")).to_contain_text("demo")
        expect(page.locator("#auth")).to_be_hidden()
        expect(page.locator("#generate")).to_be_enabled()
        # The browser logs each refused response; nothing else may have gone wrong.
        assert tab.errors and all("401" in each for each in tab.errors), tab.errors
