"""Bad requests to `klein serve`: each a 4xx with OpenAI's JSON error naming the problem, the server
healthy after each (the shared server of `serve_url`: limits 3 references, 1 MP, 1 MiB, 64 MiB)."""

import io
import socket
from urllib.parse import urlsplit

import httpx
import numpy as np
import PIL.Image
import pytest

from klein.serve.schema import MAX_PROMPT_CHARS
from tests.support.serve_process import png

EPS = (  # a PostScript file: Pillow's EPS plugin hands it to Ghostscript to decode
    b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 64 64\n%%EndComments\n"
    b"newpath 0 0 moveto 64 64 lineto stroke\nshowpage\n%%EOF\n"
)
GOOD = {"prompt": "a fox", "size": "64x64", "num_inference_steps": 2}


def generations(**changes):
    body = {**GOOD, **changes}
    return lambda url: httpx.post(
        url + "/v1/images/generations", json={k: v for k, v in body.items() if v != ...}, timeout=120
    )


def job(**changes):
    return lambda url: httpx.post(url + "/v1/jobs", json={**GOOD, **changes})


def edits(images, **fields):
    data = {"prompt": "a fox", "num_inference_steps": "2", **fields}
    files = [("image[]", i) for i in images]
    return lambda url: httpx.post(url + "/v1/images/edits", data=data, files=files, timeout=120)


def truncated_png() -> bytes:
    return png(1)[:300]


def bomb_png(side: int = 3000) -> bytes:
    """A small file whose header says side x side pixels (zeros compress a thousandfold)."""
    buffer = io.BytesIO()
    PIL.Image.fromarray(np.zeros((side, side), np.uint8)).save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


def chunked(url: str, path: str, content_type: bytes, head: bytes, filler: bytes) -> tuple[int, bytes]:
    """A body streamed in chunks without Content-Length, `head` then `filler` bytes, larger than the
    shared server's 1 MiB cap: the status and body the server answers with, having read at most a little
    more than the cap."""
    host, port = urlsplit(url).hostname, urlsplit(url).port
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(
            b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n" % path.encode()
            + b"Content-Type: %s\r\n\r\n" % content_type
        )
        chunk = head + filler * 65536
        try:
            for _ in range(40):  # 2.5 MiB offered
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                chunk = filler * 65536
        except OSError:
            pass  # the server answered and closed while we were still sending: what we want
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            reply += data
    status = int(reply.split(b" ", 2)[1])
    return status, reply.split(b"\r\n\r\n", 1)[1]


def chunked_upload(url: str) -> tuple[int, bytes]:
    head = b'--B\r\nContent-Disposition: form-data; name="image"; filename="a.png"\r\n\r\n'
    return chunked(url, "/v1/references", b"multipart/form-data; boundary=B", head, b"\0")


def picture(format: str) -> bytes:
    """A 64x64 picture in a Pillow format (BMP, TIFF, GIF, JPEG, WEBP, ...), or a hand-made EPS file."""
    if format == "EPS":
        return EPS
    buffer = io.BytesIO()
    PIL.Image.open(io.BytesIO(png(5))).save(buffer, format=format)
    return buffer.getvalue()


def json_over_the_cap(url: str) -> httpx.Response:
    body = b'{"prompt": "' + b"a" * 2**21 + b'", "size": "64x64"}'
    return httpx.post(
        url + "/v1/images/generations", content=body, headers={"Content-Type": "application/json"}
    )


CASES = [
    ("missing prompt", generations(prompt=...), 400, "prompt"),
    ("prompt not a string", generations(prompt=42), 400, "prompt"),
    ("n as a string", generations(n="2"), 400, "n"),
    ("n zero", generations(n=0), 400, "n"),
    ("n above the limit", generations(n=11), 400, "n"),
    ("size not WxH", generations(size="big"), 400, "size"),
    ("size under 16 px", generations(size="8x64"), 400, "size"),
    ("size over max pixels", generations(size="2048x2048"), 400, "size"),
    ("steps zero", generations(num_inference_steps=0), 400, "num_inference_steps"),
    ("steps above the limit", generations(num_inference_steps=51), 400, "num_inference_steps"),
    ("negative seed", generations(seed=-1), 400, "seed"),
    ("guidance not a number", generations(guidance_scale="high"), 400, "guidance_scale"),
    ("url response format", generations(response_format="url"), 400, "response_format"),
    ("cache setting unknown", generations(cache={"thresh": 0.2}), 400, "cache"),
    ("cache threshold not a number", generations(cache="threshold=high"), 400, "cache"),
    ("cache a number", generations(cache=3), 400, "cache"),
    ("cache mask of another length", generations(cache={"mask": [1, 0, 1]}), 400, "cache"),
    ("cache form field not JSON", edits([png(1)], cache="{threshold"), 400, "cache"),
    ("unknown reference id", generations(references="0123abcd"), 404, "references"),
    ("cannot fit", generations(size="1024x960", n=10), 422, None),
    (
        "body not JSON",
        lambda url: httpx.post(
            url + "/v1/images/generations", content=b"{nope", headers={"Content-Type": "application/json"}
        ),
        400,
        None,
    ),
    ("edit without images", edits([]), 400, "image"),
    ("too many references", edits([png(i) for i in range(4)]), 400, "image"),
    ("not an image", edits([b"GIF89a but not really"]), 400, "image"),
    ("truncated image", edits([truncated_png()]), 400, "image"),
    ("image too small", edits([png(1, 32, 32)]), 400, "image"),
    ("image too elongated", edits([png(1, 64, 600)]), 400, "image"),
    ("decompression bomb", edits([bomb_png()]), 400, "image"),
    ("seed form field not a number", edits([png(1)], seed="abc"), 400, "seed"),
    ("images and a reference id", edits([png(1)], references="0123abcd"), 400, "references"),
    (
        "unexpected file field",
        lambda url: httpx.post(url + "/v1/references", files=[("mask", png(1))]),
        400,
        "mask",
    ),
    (
        "upload over the cap",
        lambda url: httpx.post(url + "/v1/references", files=[("image", bytes(2**21))]),
        413,
        None,
    ),
    ("unknown reference to get", lambda url: httpx.get(url + "/v1/references/nope"), 404, "id"),
    ("unknown reference to delete", lambda url: httpx.delete(url + "/v1/references/nope"), 404, "id"),
    ("unknown job", lambda url: httpx.get(url + "/v1/jobs/nope"), 404, "id"),
    ("job with a bad body", lambda url: httpx.post(url + "/v1/jobs", json={"prompt": ""}), 400, "prompt"),
    ("job that cannot fit", job(size="1024x960", n=10), 422, None),
    ("job with an unknown reference id", job(references="0123abcd"), 404, "references"),
    ("unknown route", lambda url: httpx.get(url + "/v1/nothing"), 404, None),
    ("a misspelt field", generations(num_inference_step=2), 400, "num_inference_step"),
    ("the CLI's name of a field", generations(steps=2), 400, "steps"),
    ("diffusers' negative prompt", generations(negative_prompt="blur"), 400, "negative_prompt"),
    ("a misspelt job field", job(sede=3), 400, "sede"),
    ("a misspelt form field", edits([png(1)], strenght="0.5"), 400, "strenght"),
    ("JSON to the edits route", lambda url: httpx.post(url + "/v1/images/edits", json=GOOD), 415, None),
    ("JSON to the references route", lambda url: httpx.post(url + "/v1/references", json={}), 415, None),
    (
        "a form to the generations route",
        lambda url: httpx.post(url + "/v1/images/generations", data=GOOD, files=[("image", png(1))]),
        415,
        None,
    ),
    (
        "a form to the jobs route",
        lambda url: httpx.post(url + "/v1/jobs", data={"prompt": "a fox"}),
        415,
        None,
    ),
    ("prompt over the cap", generations(prompt="a" * (MAX_PROMPT_CHARS + 1)), 400, "prompt"),
    ("form prompt over the cap", edits([png(1)], prompt="a" * (MAX_PROMPT_CHARS + 1)), 400, "prompt"),
    ("JSON body over the cap", json_over_the_cap, 413, None),
    *((f"a {kind} upload", edits([picture(kind)]), 400, "image") for kind in ("BMP", "TIFF", "GIF", "EPS")),
    (
        "a GIF mask",
        lambda url: httpx.post(
            url + "/v1/images/edits",
            data={"prompt": "a fox"},
            files=[("image", png(1)), ("mask", picture("GIF"))],
        ),
        400,
        "mask",
    ),
]


@pytest.mark.parametrize(("send", "status", "param"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request_is_a_4xx_json_error_and_the_server_stays_healthy(serve_url, send, status, param):
    response = send(serve_url)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error" and error["code"]
    assert len(error["message"]) > 20
    assert httpx.get(serve_url + "/healthz").status_code == 200


def test_cannot_fit_says_the_estimate(serve_url):
    error = generations(size="1024x960", n=10)(serve_url).json()["error"]
    assert error["code"] == "cannot_fit" and "GiB" in error["message"] and "64.0 MiB" in error["message"]


def test_an_upload_streamed_past_the_cap_is_refused_before_it_is_read(serve_url):
    status, body = chunked_upload(serve_url)
    assert status == 413 and b"upload_too_large" in body
    assert httpx.get(serve_url + "/healthz").status_code == 200


def test_bombs_are_refused_from_their_headers(serve_url):
    # Over --max-pixels: klein's header check; over twice that, PIL's own guard (set from --max-pixels), in klein's words.
    for side, words in (
        (1200, "1200x1200 px, more than the 1000x1000 px allowed"),
        (3000, "3000x3000 px, more than the 1000x1000 px allowed"),
    ):
        bomb = bomb_png(side)
        assert len(bomb) < 64 * 1024  # well under the upload cap: the pixel count is what refuses it
        error = edits([bomb])(serve_url).json()["error"]
        assert words in error["message"] and error["code"] == "invalid_image"


def test_an_unknown_field_is_named_with_the_nearest_known_one(serve_url):
    hints = {
        "num_inference_step": "did you mean 'num_inference_steps'?",
        "steps": "did you mean 'num_inference_steps'?",
        "strenght": "did you mean 'strength'?",
        "negative_prompt": "klein takes no negative prompt",
        "colour": "the fields are prompt, n, size",
    }
    for field, hint in hints.items():
        error = generations(**{field: 1})(serve_url).json()["error"]
        assert error["code"] == "unknown_field" and hint in error["message"], error
    form = edits([png(1)], strenght="0.5")(serve_url).json()["error"]
    assert "did you mean 'strength'?" in form["message"]


def test_openai_fields_klein_does_not_use_are_accepted_with_a_warning(serve_url):
    extra = {"user": "u-1", "background": "transparent", "output_format": "jpeg", "moderation": "low"}
    answer = generations(num_inference_steps=1, **extra)(serve_url)
    assert answer.status_code == 200, answer.text
    warnings = " ".join(answer.json()["klein"]["warnings"])
    assert "background is ignored" in warnings and "moderation is ignored" in warnings
    assert "output_format 'jpeg' is ignored" in warnings and "user" not in warnings  # an id, nothing asked


@pytest.mark.parametrize("kind", ["JPEG", "WEBP"])
def test_jpeg_and_webp_uploads_are_taken(serve_url, kind):
    answer = edits([picture(kind)], num_inference_steps="1")(serve_url)
    assert answer.status_code == 200, answer.text


def test_format_refusals_name_the_accepted_formats(serve_url):
    for kind in ("BMP", "TIFF", "GIF", "EPS"):
        error = edits([picture(kind)])(serve_url).json()["error"]
        assert "not a PNG, JPEG or WEBP image" in error["message"], (kind, error)


def test_json_to_a_form_route_says_what_to_send(serve_url):
    error = httpx.post(serve_url + "/v1/images/edits", json=GOOD).json()["error"]
    assert "multipart/form-data" in error["message"] and "/v1/images/generations" in error["message"]


def test_a_json_body_is_capped_with_and_without_content_length(serve_url):
    declared = json_over_the_cap(serve_url)
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "upload_too_large"
    status, body = chunked(serve_url, "/v1/images/generations", b"application/json", b'{"prompt": "', b"a")
    assert status == 413 and b"upload_too_large" in body
    assert httpx.get(serve_url + "/healthz").status_code == 200


def test_a_prompt_longer_than_the_text_encoder_reads_is_cut_with_a_warning(serve_url):
    answer = generations(prompt="fox " * 1500, num_inference_steps=1)(serve_url)
    assert answer.status_code == 200, answer.text
    warnings = answer.json()["klein"]["warnings"]
    assert any("tokens with its chat template; the text encoder reads 512" in w for w in warnings), warnings
