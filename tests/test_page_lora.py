"""The page's LoRA picker in real headless Chromium, against a real `klein serve --lora-dir` (demo
checkpoint).

The picker lists the LoRAs the server offers (GET /v1/loras) and no other; a LoRA ticked with a scale goes
as the request's `loras`, in a job's JSON body and as JSON text in a repaint's form, and its image differs
from the same seed's without it; "Reuse settings" ticks it again. A server that offers none shows no
picker. Throughout: no console errors.
"""

import io
import json

import numpy as np
import PIL.Image
import pytest
from playwright.sync_api import expect

from klein.io import demo
from klein.models.transformer_config import TransformerConfig
from tests.support import lora_files as lf
from tests.support.serve_process import running
from tests.test_page import SERVE_FLAGS, generate, new_tab
from tests.test_page_mask import RECORD_FORMS, edits_sent, fix_seed, shown_png, source_file

SIZE = (64, 64)


@pytest.fixture(scope="module")
def server(klein_home, tmp_path_factory):
    """The URL of a `klein serve` offering two LoRAs, "ink" and "pen", from a folder."""
    folder = tmp_path_factory.mktemp("page-loras")
    shapes = lf.linear_shapes(TransformerConfig.from_diffusers(demo.TRANSFORMER), "bfl")
    lf.write_bfl(folder / "ink.safetensors", lf.random_lora(shapes, 4, 2))
    lf.write_bfl(folder / "pen.safetensors", lf.random_lora(shapes, 4, 3))
    with running(klein_home, *map(str, SERVE_FLAGS), "--lora-dir", str(folder)) as url:
        yield url


@pytest.fixture
def tab(server, browser):
    with new_tab(browser, server) as opened:
        opened.page.add_init_script(RECORD_FORMS)
        yield opened


def job_bodies(page) -> list:
    """The JSON body of every POST /v1/jobs the page sends from here on."""
    bodies = []
    page.on(
        "request",
        lambda r: r.method == "POST" and r.url.endswith("/v1/jobs") and bodies.append(r.post_data_json),
    )
    return bodies


def set_size(page) -> None:
    page.select_option("#size", "custom")
    page.fill("#width", str(SIZE[0]))
    page.fill("#height", str(SIZE[1]))


def pixels(png: bytes) -> np.ndarray:
    return np.asarray(PIL.Image.open(io.BytesIO(png)).convert("RGB"), np.int16)


def test_a_picked_lora_is_sent_with_its_scale_and_changes_the_image(tab):
    page = tab.page
    bodies = job_bodies(page)
    tab.open()
    expect(page.locator("#loras-panel")).to_be_visible()
    expect(page.locator(".lora-name")).to_have_text(["ink", "pen"])
    expect(page.get_by_label("Scale of ink")).to_have_value("1")
    set_size(page)
    fix_seed(page, 5)
    generate(page, "a fox", 1)
    plain = shown_png(page)
    page.get_by_label("ink", exact=True).check()
    page.get_by_label("Scale of ink").fill("0.8")
    generate(page, "a fox", 2)
    inked = shown_png(page)
    assert [body.get("loras") for body in bodies] == [None, [{"name": "ink", "scale": 0.8}]]
    expect(page.locator("#current .facts")).to_contain_text("ink × 0.8")
    recorded = PIL.Image.open(io.BytesIO(inked)).text  # the PNG's metadata: the LoRA the image ran under
    assert recorded["lora_apply"] == '["ink:0.8"]'
    assert PIL.Image.open(io.BytesIO(plain)).text.get("lora_apply", "[]") == "[]"
    assert np.abs(pixels(inked) - pixels(plain)).mean() > 2
    # The first result's settings again: no LoRA ticked; the second's: ink at 0.8.
    page.locator("#history .history-item").nth(1).click()
    page.get_by_role("button", name="Reuse these settings").click()
    expect(page.get_by_label("ink", exact=True)).not_to_be_checked()
    page.locator("#history .history-item").nth(0).click()
    page.get_by_role("button", name="Reuse these settings").click()
    expect(page.get_by_label("ink", exact=True)).to_be_checked()
    expect(page.get_by_label("Scale of ink")).to_have_value("0.8")
    assert not tab.errors


def test_a_repaint_sends_the_loras_as_json_text_and_a_bad_scale_is_named(tab):
    page = tab.page
    tab.open()
    page.set_input_files("#ref-input", [source_file(size=SIZE)])
    page.fill("#strength", "0.6")
    page.get_by_label("pen", exact=True).check()
    page.get_by_label("Scale of pen").fill("")
    page.fill("#prompt", "a fox")
    page.click("#generate")
    expect(page.locator("#error")).to_contain_text("scale of LoRA pen")
    expect(page.get_by_label("Scale of pen")).to_be_focused()
    page.get_by_label("Scale of pen").fill("0.5")
    generate(page, "a fox", 1)
    (form,) = edits_sent(page)
    assert json.loads(form["loras"][0]) == [{"name": "pen", "scale": 0.5}]
    assert not tab.errors
