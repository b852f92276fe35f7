"""The OpenAPI docs at /docs work offline: headless Chromium, every request to another host refused, still
lists the endpoints (Swagger UI's files come from the package, not a CDN); /redoc, which needs one, is
gone. The API key guards /docs and /openapi.json as it guards the API; Swagger UI's files need none."""

import io
import types
from urllib.parse import urlsplit

from fastapi.testclient import TestClient
from playwright.sync_api import expect

from klein.serve.app import create_app
from klein.serve.metrics import Metrics
from klein.serve.options import ServeOptions
from klein.serve.security import Access, ApiKey
from tests.support.pictures import picture

ENDPOINTS = ("/v1/images/generations", "/v1/images/edits", "/v1/references", "/v1/jobs")
KEY = "docs-key"


def test_docs_list_the_endpoints_with_no_network_but_the_server(serve_url, browser, tmp_path):
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    blocked = []

    def only_the_server(route):
        url = route.request.url
        if urlsplit(url).netloc == urlsplit(serve_url).netloc:
            route.continue_()
        else:
            blocked.append(url)
            route.abort("internetdisconnected")

    context.route("**/*", only_the_server)
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(f"{serve_url}/docs")
    for path in ENDPOINTS:
        expect(page.get_by_text(path, exact=True)).to_be_visible(timeout=30_000)  # a loaded machine
    expect(page.locator(".info .title")).to_contain_text("klein serve")
    page.screenshot(path=tmp_path / "docs.png", full_page=True)
    context.close()
    assert not blocked, f"the docs asked another host: {blocked}"
    assert not errors, errors


def fake_service(api_key):
    """What the routes read of a Service before any request reaches the pipeline."""
    access = Access(keys=(ApiKey(api_key, "test"),) if api_key else ())
    return types.SimpleNamespace(version="test", options=ServeOptions(access=access), metrics=Metrics())


def test_a_keyed_server_opens_docs_schema_and_swagger_files_without_the_key_but_not_the_api():
    """/docs holds no data and a browser opens it without sending a key: the key guards the API calls."""
    client = TestClient(create_app(fake_service(KEY)), base_url="http://localhost")
    page = client.get("/docs")
    assert page.status_code == 200 and "'openapi.json'" in page.text
    assets = [part.split('"')[0] for part in page.text.split('="static/docs/')[1:]]
    assert len(assets) == 3, page.text  # script, style sheet, icon
    for name in assets:
        assert client.get(f"/static/docs/{name}").status_code == 200, name
    assert client.get("/openapi.json").status_code == 200
    assert client.get("/v1/config").status_code == 401
    assert client.get("/static/docs/LICENSE").status_code == 404
    assert client.get("/redoc", headers={"Authorization": f"Bearer {KEY}"}).status_code == 404


def test_without_a_key_docs_and_schema_are_open():
    client = TestClient(create_app(fake_service(None)), base_url="http://localhost")
    assert client.get("/docs").status_code == 200
    assert "/v1/images/edits" in client.get("/openapi.json").json()["paths"]


def test_the_schema_describes_the_multipart_bodies_the_answers_and_this_servers_limits():
    service = fake_service(None)
    service.options = ServeOptions(access=service.options.access, max_steps=7, max_images=3)
    openapi = TestClient(create_app(service), base_url="http://localhost").get("/openapi.json").json()
    schemas = openapi["components"]["schemas"]
    edits = openapi["paths"]["/v1/images/edits"]["post"]
    form = edits["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert form["properties"]["image"]["items"] == {"type": "string", "format": "binary"}
    assert form["properties"]["mask"]["format"] == "binary" and form["required"] == ["prompt"]
    assert {"num_inference_steps", "seed", "strength", "size", "n"} <= set(form["properties"])
    references = openapi["paths"]["/v1/references"]["post"]["requestBody"]["content"]["multipart/form-data"]
    assert references["schema"]["properties"]["image"]["type"] == "array"
    for path in ("/v1/images/generations", "/v1/images/edits"):
        answer = openapi["paths"][path]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
        assert answer == {"$ref": "#/components/schemas/ImagesResponse"}
        error = openapi["paths"][path]["post"]["responses"]["400"]["content"]["application/json"]["schema"]
        assert error == {"$ref": "#/components/schemas/ErrorBody"}
    assert {"created", "data", "klein"} <= set(schemas["ImagesResponse"]["properties"])
    # The steps and images this server takes, not the request type's 1-1000, in the JSON and the form.
    for fields in (schemas["ImageBody"]["properties"], form["properties"]):
        steps = fields["num_inference_steps"]
        assert [each["maximum"] for each in steps["anyOf"] if each.get("type") == "integer"] == [7]
        assert "1 to 7" in steps["description"] and "1000" not in steps["description"]
        assert fields["n"]["maximum"] == 3


def test_try_it_out_sends_an_edit_with_an_image_file(serve_url, browser):
    """Swagger UI's form for /v1/images/edits: a file picked, the prompt typed, every other field left
    blank (it sends them empty: as if not sent), and the server answers 200 with a PNG."""
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    page.goto(f"{serve_url}/docs")
    edits = page.locator("#operations-default-edits_v1_images_edits_post")
    edits.locator(".opblock-summary").click()
    edits.get_by_role("button", name="Try it out").click()
    edits.locator("tr[data-property-name=prompt] input[type=text]").first.fill("a fox")
    png = io.BytesIO()
    picture(64, 64, 0).save(png, "PNG")
    edits.locator("tr[data-property-name=image] input[type=file]").set_input_files(
        [{"name": "fox.png", "mimeType": "image/png", "buffer": png.getvalue()}]
    )
    edits.get_by_role("button", name="Execute").click()
    status = edits.locator(".live-responses-table tbody .response-col_status").first
    expect(status).to_have_text("200", timeout=120_000)
    expect(edits.locator(".live-responses-table tbody")).to_contain_text('"b64_json"')
    page.close()
