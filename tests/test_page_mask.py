"""The page's mask brush in real headless Chromium, against a real `klein serve` (demo checkpoint).

A stroke painted with the pointer over the source (the first reference) leaves as the edit's `mask` file
in OpenAI's convention (fully transparent where painted, opaque elsewhere) at the source's own pixel
size, and the result is repainted there; erase, invert and clear change the mask sent; with nothing
painted no mask goes (a plain edit); a strength reaches the server; "Use as source" puts the result first
and keeps the mask, as a reload does; touch paints as the mouse does.

The demo model is a tiny random network whose VAE decoder mixes the whole image (its round trip is far
from the source everywhere), so "outside the mask the result is the source's round trip" cannot be
measured on it. What is measured: two seeds repaint the masked area differently and leave the rest
nearly alike, and a masked edit differs from the unmasked one.
"""

import base64
import io

import numpy as np
import PIL.Image
import PIL.ImageFilter
import pytest
from playwright.sync_api import expect

from tests.support.pictures import picture
from tests.test_page import GENERATION_TIMEOUT_MS, SERVE_FLAGS, generate, new_tab

SOURCE = (128, 96)  # width, height: multiples of 16, so a result has the source's size
BRUSH = 64  # px of the image as shown: a band wider than a 16 px token, so it covers token centres

# Every multipart form the page sends through XMLHttpRequest, with its files' bytes (Chromium does not
# give a request's blob parts to the test): window.sentForms, [{url, fields: [[name, text or file]]}].
RECORD_FORMS = """
window.sentForms = [];
const open = XMLHttpRequest.prototype.open, send = XMLHttpRequest.prototype.send;
const dataURL = (blob) => new Promise((resolve) => {
  const reader = new FileReader();
  reader.onload = () => resolve(reader.result);
  reader.readAsDataURL(blob);
});
XMLHttpRequest.prototype.open = function (method, url, ...rest) {
  this.recordedURL = url;
  return open.call(this, method, url, ...rest);
};
XMLHttpRequest.prototype.send = function (body) {
  if (body instanceof FormData) {
    const fields = Promise.all([...body.entries()].map(async ([name, value]) =>
      [name, typeof value === "string" ? value : {name: value.name, type: value.type, data: await dataURL(value)}]));
    window.sentForms.push(fields.then((entries) => ({url: this.recordedURL, fields: entries})));
  }
  return send.call(this, body);
};
"""


@pytest.fixture(scope="module")
def server(serve_with):
    return serve_with(*SERVE_FLAGS)  # test_page.py's server, where the same worker has started it


@pytest.fixture
def tab(server, browser):
    with new_tab(browser, server) as opened:
        opened.page.add_init_script(RECORD_FORMS)
        yield opened


def source_file(seed: int = 3, size: tuple[int, int] = SOURCE) -> dict:
    buffer = io.BytesIO()
    picture(*size, seed).save(buffer, "PNG")
    return {"name": "source.png", "mimeType": "image/png", "buffer": buffer.getvalue()}


def open_with_source(tab) -> None:
    tab.open()
    tab.page.set_input_files("#ref-input", [source_file()])
    expect(tab.page.locator("#mask-editor")).to_be_visible()
    expect(tab.page.locator("#mask-count")).to_have_text("none")
    tab.page.locator("#brush-size").fill(str(BRUSH))


def stroke(page, *points, steps: int = 8) -> None:
    """A press, drag and release of the mouse through `points`, fractions (x, y) of the shown source."""
    page.locator("#mask-canvas").scroll_into_view_if_needed()
    box = page.locator("#mask-canvas").bounding_box()

    def at(fx, fy):
        return box["x"] + fx * box["width"], box["y"] + fy * box["height"]

    page.mouse.move(*at(*points[0]))
    page.mouse.down()
    for point in points[1:]:
        page.mouse.move(*at(*point), steps=steps)
    page.mouse.up()


def brush_radius(page) -> float:
    """The brush's radius in source pixels."""
    return BRUSH / 2 * SOURCE[0] / page.locator("#mask-canvas").bounding_box()["width"]


def fix_seed(page, seed: int) -> None:
    page.get_by_text("Fixed", exact=True).click()
    page.get_by_label("Seed value").fill(str(seed))


def sent_forms(page) -> list[dict]:
    return page.evaluate("Promise.all(window.sentForms)")


def edits_sent(page) -> list[dict]:
    """{field name: [text, or bytes of a file]} of each POST /v1/images/edits so far."""
    forms = []
    for form in sent_forms(page):
        if not form["url"].endswith("v1/images/edits"):
            continue
        fields = {}
        for name, value in form["fields"]:
            if isinstance(value, dict):
                value = base64.b64decode(value["data"].split(",", 1)[1])
            fields.setdefault(name, []).append(value)
        forms.append(fields)
    return forms


def alpha(png: bytes, size: tuple[int, int] = SOURCE) -> np.ndarray:
    """The alpha channel of a mask PNG, checked to be OpenAI's kind: RGBA at the source's size, each
    pixel either fully transparent (repaint) or opaque (keep)."""
    image = PIL.Image.open(io.BytesIO(png))
    assert image.size == size and image.mode == "RGBA", (image.size, image.mode)
    values = np.asarray(image)[..., 3]
    assert set(np.unique(values)) <= {0, 255}
    return values


def transparent_at(values: np.ndarray, fx: float, fy: float) -> bool:
    height, width = values.shape
    return values[int(fy * height), int(fx * width)] == 0


def pixels(png: bytes) -> np.ndarray:
    return np.asarray(PIL.Image.open(io.BytesIO(png)).convert("RGB"), np.int16)


def response_png(response) -> bytes:
    return base64.b64decode(response.json()["data"][0]["b64_json"])


def shown_png(page) -> bytes:
    """The PNG of the result shown."""
    read = """img => fetch(img.src).then((r) => r.blob()).then((blob) => new Promise((resolve) => {
      const reader = new FileReader();
      reader.onload = () => resolve(reader.result);
      reader.readAsDataURL(blob);
    }))"""
    return base64.b64decode(page.eval_on_selector("#current .result img", read).split(",", 1)[1])


def test_a_painted_stroke_is_the_mask_sent_and_the_area_repainted(tab):
    page = tab.page
    open_with_source(tab)
    stroke(page, (0.15, 0.5), (0.45, 0.5))
    expect(page.locator("#mask-count")).to_contain_text("% painted")
    fix_seed(page, 1)
    with page.expect_response("**/v1/images/edits", timeout=GENERATION_TIMEOUT_MS) as first:
        generate(page, "a red hat", results=1)

    # The mask went with the source, at its size: transparent along the stroke, opaque elsewhere.
    (form,) = edits_sent(page)
    assert len(form["image"]) == 1 and "strength" not in form and form["prompt"] == ["a red hat"]
    mask = alpha(form["mask"][0])
    radius = brush_radius(page)
    width, height = SOURCE
    for fx in (0.15, 0.3, 0.45):
        assert transparent_at(mask, fx, 0.5), fx
    for fx, fy in ((0.02, 0.5), (0.6, 0.5), (0.3, 0.2), (0.3, 0.8), (0.9, 0.9)):
        assert not transparent_at(mask, fx, fy), (fx, fy)
    rows, columns = np.nonzero(mask == 0)
    assert columns.min() >= 0.15 * width - radius - 1 and columns.max() <= 0.45 * width + radius + 1
    assert rows.min() >= 0.5 * height - radius - 1 and rows.max() <= 0.5 * height + radius + 1
    painted_area = 0.3 * width * 2 * radius + np.pi * radius**2
    assert 0.8 < len(rows) / painted_area < 1.2, (len(rows), painted_area)

    # What ran: the server's default strength with a mask, shown with the result and its mask.
    assert first.value.json()["klein"]["settings"]["strength"] == 0.8
    expect(page.locator("#current .facts")).to_contain_text("Strength")
    expect(page.locator("#current .fact-mask img")).to_have_count(1)
    # The demo says, with the result, that its random weights cannot show the unmasked area kept.
    expect(page.locator("#current .warning")).to_contain_text(["cannot show inpainting keeping the unmasked"])
    assert "inpainting with a mask at strength 0.8" in first.value.json()["klein"]["settings"]["mode"]

    # Another seed repaints the masked area otherwise and leaves the rest nearly as it was.
    fix_seed(page, 2)
    with page.expect_response("**/v1/images/edits", timeout=GENERATION_TIMEOUT_MS) as second:
        generate(page, "a red hat", results=2)
    one, two = pixels(response_png(first.value)), pixels(response_png(second.value))
    painted = mask == 0
    near = PIL.Image.fromarray(painted.astype(np.uint8) * 255).filter(PIL.ImageFilter.MaxFilter(33))
    far = np.asarray(near) == 0  # more than 16 px from the mask
    inside, outside = np.abs(one - two)[painted].mean(), np.abs(one - two)[far].mean()
    assert inside > 3 * outside, (inside, outside)  # about 107 and 21 on the demo model
    # As the demo's note says: where the mask keeps the source, not the source but a near-flat colour.
    expect(page.locator("#current .warning")).to_contain_text(["that area comes out a near-flat colour"])
    source = pixels(source_file()["buffer"])
    kept, repainted = (one[area].std(axis=0).mean() for area in (far, painted))
    assert kept < repainted / 2 and np.abs(one - source)[far].mean() > 25  # about 32, 91 and 50

    # Cleared, the mask is not sent: a plain edit through a job, whose image differs from the masked one.
    page.click("#mask-clear")
    expect(page.locator("#mask-count")).to_have_text("none")
    fix_seed(page, 1)
    generate(page, "a red hat", results=3)
    assert len(edits_sent(page)) == 2
    assert any(request.endswith("/v1/jobs") for request in tab.requests)
    plain = pixels(shown_png(page))
    assert np.abs(plain - one).mean() > 10
    assert not tab.errors, tab.errors


def test_erase_invert_clear_and_strength_change_what_is_sent(tab):
    page = tab.page
    open_with_source(tab)
    stroke(page, (0.1, 0.5), (0.9, 0.5))
    page.get_by_text("Erase", exact=True).click()
    stroke(page, (0.5, 0.2), (0.5, 0.8))
    page.fill("#strength", "0.5")
    with page.expect_response("**/v1/images/edits", timeout=GENERATION_TIMEOUT_MS) as erased:
        generate(page, "a band", results=1)
    mask = alpha(edits_sent(page)[-1]["mask"][0])
    assert transparent_at(mask, 0.25, 0.5) and transparent_at(mask, 0.75, 0.5)
    assert not transparent_at(mask, 0.5, 0.5)  # erased
    assert edits_sent(page)[-1]["strength"] == ["0.5"]
    assert erased.value.json()["klein"]["settings"]["strength"] == 0.5

    # Inverted: exactly the other pixels.
    page.click("#mask-invert")
    generate(page, "the rest", results=2)
    inverted = alpha(edits_sent(page)[-1]["mask"][0])
    assert np.array_equal(inverted, 255 - mask)

    # Cleared with a strength: image-to-image, no mask sent.
    page.click("#mask-clear")
    with page.expect_response("**/v1/images/edits", timeout=GENERATION_TIMEOUT_MS) as whole:
        generate(page, "all of it", results=3)
    assert "mask" not in edits_sent(page)[-1] and len(edits_sent(page)) == 3
    assert whole.value.json()["klein"]["settings"]["strength"] == 0.5

    # Neither: a plain edit, through a job.
    page.fill("#strength", "")
    generate(page, "plain", results=4)
    assert len(edits_sent(page)) == 3
    assert not tab.errors, tab.errors


def test_use_as_source_keeps_the_mask_as_a_reload_does(tab):
    page = tab.page
    open_with_source(tab)
    stroke(page, (0.6, 0.3), (0.8, 0.7))
    painted = page.locator("#mask-count").inner_text()
    assert painted.endswith("% painted")
    generate(page, "a scarf", results=1)
    mask = alpha(edits_sent(page)[-1]["mask"][0])
    result = shown_png(page)

    # The result takes the source's place (first, the list no longer), the mask stays for another try.
    page.click("#current .use-source")
    expect(page.locator("#refs li")).to_have_count(1)
    name = page.locator("#current .download").get_attribute("download")
    expect(page.locator("#refs .ref-name")).to_have_text([name])
    expect(page.locator("#mask-count")).to_have_text(painted)
    generate(page, "a longer scarf", results=2)
    sent = edits_sent(page)[-1]
    assert np.array_equal(alpha(sent["mask"][0]), mask)
    assert sent["image"] == [result]  # the result's PNG as the server sent it

    page.reload()
    expect(page.locator("#generate")).to_be_enabled()
    expect(page.locator("#mask-count")).to_have_text(painted)
    generate(page, "a scarf again", results=3)
    assert np.array_equal(alpha(edits_sent(page)[-1]["mask"][0]), mask)

    # Another source starts with no mask.
    page.get_by_role("button", name="Remove reference 1").click()
    expect(page.locator("#mask-empty")).to_be_visible()
    page.set_input_files("#ref-input", [source_file(4)])
    expect(page.locator("#mask-count")).to_have_text("none")
    assert not tab.errors, tab.errors


def test_a_result_of_another_size_keeps_the_mask_resized(tab):
    """A source whose sides are not multiples of 16 is repainted at a size rounded down to them: the mask
    follows the result, resized."""
    page = tab.page
    tab.open()
    page.set_input_files("#ref-input", [source_file(5, (136, 100))])
    page.locator("#brush-size").fill(str(BRUSH))
    stroke(page, (0.2, 0.3), (0.5, 0.6))
    generate(page, "a kite", results=1)
    before = alpha(edits_sent(page)[-1]["mask"][0], (136, 100))
    page.click("#current .use-source")
    expect(page.locator("#refs .ref-size")).to_have_text(["128 × 96"])
    expect(page.locator("#mask-count")).to_contain_text("% painted")
    generate(page, "a red kite", results=2)
    after = alpha(edits_sent(page)[-1]["mask"][0], (128, 96))
    resized = np.asarray(PIL.Image.fromarray(before).resize((128, 96), PIL.Image.Resampling.NEAREST))
    assert np.mean(after != resized) < 0.02
    assert not tab.errors, tab.errors


def test_touch_paints_as_the_mouse_does(server, browser):
    context = browser.new_context(viewport={"width": 800, "height": 1000}, has_touch=True)
    try:
        page = context.new_page()
        page.goto(f"{server}/")
        expect(page.locator("#generate")).to_be_enabled()
        page.set_input_files("#ref-input", [source_file()])
        # The canvas is laid out once the source has loaded: wait for it as a stroke does.
        page.locator("#mask-canvas").scroll_into_view_if_needed()
        box = page.locator("#mask-canvas").bounding_box()
        devtools = context.new_cdp_session(page)
        y = box["y"] + box["height"] / 2
        for kind, fx in (("touchStart", 0.2), ("touchMove", 0.4), ("touchMove", 0.6), ("touchEnd", None)):
            points = [] if fx is None else [{"x": box["x"] + fx * box["width"], "y": y}]
            devtools.send("Input.dispatchTouchEvent", {"type": kind, "touchPoints": points})
        expect(page.locator("#mask-count")).to_contain_text("% painted")
        mask = page.evaluate("""async () => {
          const blob = await (await import("./static/mask.js")).file();
          return [...new Uint8Array(await blob.arrayBuffer())];
        }""")
        values = alpha(bytes(mask))
        assert transparent_at(values, 0.3, 0.5) and transparent_at(values, 0.5, 0.5)
        assert not transparent_at(values, 0.5, 0.1)
    finally:
        context.close()


def test_strength_out_of_range_is_refused_by_the_page_or_the_server(tab):
    page = tab.page
    open_with_source(tab)
    page.fill("#prompt", "a hat")
    page.fill("#strength", "1.5")
    page.click("#generate")
    expect(page.locator("#error")).to_contain_text("Strength must be a number from 0 to 1")
    expect(page.locator("#strength")).to_be_focused()

    # 0 is within the bounds, but leaves no step to run: the server says so; nothing entered is lost.
    stroke(page, (0.2, 0.2), (0.4, 0.4))
    page.fill("#strength", "0")
    page.click("#generate")
    expect(page.locator("#error")).to_contain_text("no denoising step")
    expect(page.locator("#strength")).to_have_value("0")
    expect(page.locator("#mask-count")).to_contain_text("% painted")  # kept
    assert len(tab.errors) == 1 and "400" in tab.errors[0], tab.errors
    assert not any(request.endswith("/v1/jobs") for request in tab.requests)
