"""`klein serve` keeps the web's and OpenAI's conventions (the shared server of `serve_url`): numbers in ASCII
digits only, 415 for a body without a Content-Type, a named code for each multipart limit, GET /v1/models as
OpenAI's clients read it, HEAD / as GET without a body, and no response that another site may frame."""

import httpx
import openai
import pytest

from tests.support.serve_process import png

GOOD = {"prompt": "a fox", "size": "64x64", "num_inference_steps": 1}


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


@pytest.mark.parametrize("size", ["６４x３２", "64x３２", "٦٤x32"])
def test_a_size_in_other_scripts_digits_is_refused(serve_url, size):
    response = httpx.post(serve_url + "/v1/images/generations", json={**GOOD, "size": size}, timeout=60)
    error = error_of(response, 400)
    assert error["param"] == "size" and "WxH" in error["message"]


@pytest.mark.parametrize(
    ("field", "text"),
    [
        ("num_inference_steps", "1_0"),
        ("num_inference_steps", "１"),
        ("seed", "0x10"),
        ("guidance_scale", "1_0"),
    ],
)
def test_a_form_number_is_ascii_digits_only(serve_url, field, text):
    data = {"prompt": "a fox", "num_inference_steps": "1", field: text}
    response = httpx.post(serve_url + "/v1/images/edits", data=data, files=[("image", png(1))], timeout=60)
    error = error_of(response, 400)
    assert error["param"] == field and "digits 0-9" in error["message"]


def test_json_without_a_content_type_is_415(serve_url):
    for route in ("/v1/images/generations", "/v1/jobs"):
        response = httpx.post(serve_url + route, content=b'{"prompt": "a fox"}', timeout=60)
        error = error_of(response, 415)
        assert error["code"] == "unsupported_media_type" and "no Content-Type" in error["message"]


@pytest.mark.parametrize(
    ("files", "data", "code"),
    [
        ([("image", png(i)) for i in range(7)], {}, "too_many_references"),  # past the parser's own count
        ([("image", png(1))], {f"field{i}": "x" for i in range(70)}, "too_many_fields"),
        ([("image", png(1))], {"prompt": "a" * (65 * 2**10)}, "field_too_large"),
    ],
    ids=["files", "fields", "field size"],
)
def test_each_multipart_limit_has_its_own_code(serve_url, files, data, code):
    response = httpx.post(serve_url + "/v1/images/edits", data=data, files=files, timeout=60)
    assert error_of(response, 400)["code"] == code


def test_models_are_listed_as_openai_lists_them(serve_url):
    client = openai.OpenAI(base_url=serve_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    (model,) = client.models.list().data
    assert model.object == "model" and model.owned_by == "local" and model.created > 0
    # An id, as --model names the checkpoint, its description the name /healthz gives; a request naming
    # either is not told its `model` was ignored, one naming another is.
    assert model.id == "demo"
    assert model.model_extra["description"] == httpx.get(serve_url + "/healthz").json()["model"]
    body = {"prompt": "a fox", "size": "64x64", "num_inference_steps": 1, "seed": 1}
    for named, ignored in ((model.id, False), (model.model_extra["description"], False), ("dall-e-3", True)):
        warnings = httpx.post(
            serve_url + "/v1/images/generations", json={**body, "model": named}, timeout=120
        )
        said = [line for line in warnings.json()["klein"]["warnings"] if line.startswith("model ")]
        assert bool(said) == ignored, (named, said)
    assert said == [
        "model 'dall-e-3' is ignored: this server runs 'demo' (" + model.model_extra["description"] + ")"
    ]


def test_head_of_the_page_is_its_get_without_a_body(serve_url):
    head, get = httpx.head(serve_url + "/"), httpx.get(serve_url + "/")
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == get.headers["content-type"] and get.content


@pytest.mark.parametrize("path", ["/", "/docs", "/healthz", "/v1/nothing"])
def test_no_response_may_be_framed_by_another_site(serve_url, path):
    headers = httpx.get(serve_url + path).headers
    assert headers["x-frame-options"] == "DENY"
    assert headers["content-security-policy"] == "frame-ancestors 'none'"
